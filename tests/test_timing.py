"""The figures made from a request's clock: gaps, the worst 3-second rate, phases."""

from __future__ import annotations

from proxy.record.timing import RequestTimer, gap_figures, percentile, worst_window_rate


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0
    assert percentile(values, 95) == 95.0
    assert percentile([7.0], 95) == 7.0


def test_gaps_between_token_events() -> None:
    times = [0.0, 0.01, 0.02, 0.03, 1.03]
    gaps = gap_figures(times, 0.0)
    assert gaps == {"gap_p50_ms": 10.0, "gap_p95_ms": 1000.0, "gap_max_ms": 1000.0,
                    "gap_max_at_ms": 30.0}
    assert gap_figures([1.0], 0.0) == {"gap_p50_ms": None, "gap_p95_ms": None, "gap_max_ms": None,
                                       "gap_max_at_ms": None}


def test_the_longest_gap_is_placed_from_the_arrival_at_the_token_before_it() -> None:
    timer = RequestTimer(arrived=100.0)
    timer.on_sent(100.0)
    timer.on_headers(100.2, prefill_starts=True)
    for t in (101.0, 101.125, 101.25, 102.0, 102.125, 102.875):  # two 0.75 s gaps: the first counts
        timer.on_token(t)
    timer.on_end(102.8)
    f = timer.figures()
    assert (f["gap_max_ms"], f["gap_max_at_ms"]) == (750.0, 1250.0)


def test_a_stream_of_one_token_event_has_no_longest_gap() -> None:
    timer = RequestTimer(arrived=0.0)
    timer.on_token(0.5)
    timer.on_end(0.6)
    assert timer.figures()["gap_max_at_ms"] is None


def test_worst_window_finds_a_stall_in_a_steady_stream() -> None:
    steady = [i * 0.01 for i in range(1000)]  # 100 events/s for 10 s
    steady_rate = worst_window_rate(steady)
    assert steady_rate is not None and abs(steady_rate - 100.0) < 0.5
    stalled = [t for t in steady if not 4.0 < t < 6.5]  # a 2.5 s hole
    rate = worst_window_rate(stalled)
    assert rate is not None and rate < 20.0  # the worst window holds only ~0.5 s of tokens


def test_worst_window_needs_three_seconds_of_decode() -> None:
    assert worst_window_rate([0.0, 1.0, 2.9]) is None


def test_timer_phases_give_the_record_fields() -> None:
    timer = RequestTimer(arrived=10.0)
    timer.on_sent(10.001)
    timer.on_headers(10.5, prefill_starts=True)
    timer.on_progress(10.5, {"total": 100, "cache": 0, "processed": 0})
    timer.on_progress(10.9, {"total": 100, "cache": 0, "processed": 100})
    for i in range(5):
        timer.on_token(11.0 + i * 0.1)
    timer.on_end(11.5)
    f = timer.figures()
    assert (f["proxy_ms"], f["queue_ms"], f["prefill_ms"]) == (1.0, 499.0, 400.0)
    assert (f["ttft_ms"], f["decode_ms"], f["total_ms"], f["events"]) == (1000.0, 400.0, 1500.0, 5)


def test_without_progress_the_first_token_ends_the_prefill() -> None:
    timer = RequestTimer(arrived=0.0)
    timer.on_sent(0.0)
    timer.on_headers(0.2, prefill_starts=True)
    timer.on_token(0.7)
    timer.on_end(0.8)
    assert timer.figures()["prefill_ms"] == 500.0
