"""The contention benchmark's scenario: when short turns arrive."""

from __future__ import annotations

import pytest

from proxy.bench.contention import Scenario


def test_random_arrivals_are_the_same_on_every_path_and_fall_at_any_phase() -> None:
    sc = Scenario(shorts=400, short_every_s=0.5)
    offsets = sc.short_offsets()
    assert offsets == Scenario(shorts=400, short_every_s=0.5).short_offsets()  # every path alike
    # one arrival in each 0.5 s window, at a different moment of it each time
    assert all(0.3 + 0.5 * i <= t < 0.3 + 0.5 * (i + 1) for i, t in enumerate(offsets))
    phases = [(t - 0.3) % 0.5 for t in offsets]
    assert min(phases) < 0.05 and max(phases) > 0.45
    assert len({round(p, 3) for p in phases}) > 200  # not a fixed rhythm


def test_periodic_arrivals_keep_a_fixed_rhythm() -> None:
    assert Scenario(shorts=3, short_every_s=0.6, arrivals="periodic").short_offsets() == \
        pytest.approx([0.3, 0.9, 1.5])


def test_an_unknown_arrival_pattern_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="'bursty'"):
        Scenario(arrivals="bursty").short_offsets()
