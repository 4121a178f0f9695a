"""Draws a timeline as a PNG with matplotlib (Agg backend; the `plot` extra)."""

from __future__ import annotations

from proxy.report.records import InputError
from proxy.report.timeline import Timeline
from proxy.report.timeline_html import COLOURS


def write_png(tl: Timeline, title: str, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        raise InputError(
            "--timeline FILE.png needs matplotlib: pip install 'slotwise[plot]' "
            "(or write FILE.html, which needs nothing)"
        ) from None
    fig, ax = plt.subplots(figsize=(min(40.0, max(10.0, tl.duration / 3)), 1.2 + 0.55 * tl.lanes))
    for phase, colour in COLOURS.items():
        for lane in range(tl.lanes):
            spans = [(b.start, b.end - b.start) for b in tl.bars if b.phase == phase and b.lane == lane]
            if spans:
                ax.broken_barh(
                    spans, (lane - 0.35, 0.7), facecolors=colour, edgecolors="white", linewidth=0.3
                )
    for mark in tl.marks:
        ax.broken_barh(
            [(mark.start, mark.end - mark.start)],
            (mark.lane + 0.1, 0.25),
            facecolors=COLOURS["stall"],
            hatch="///",
            edgecolor="black",
            linewidth=0.3,
        )
    ax.set_yticks(range(tl.lanes), tl.lane_names)
    ax.set_ylim(tl.lanes - 0.5, -0.5)
    ax.set_xlim(0, max(tl.duration, 1e-3))
    ax.set_xlabel("seconds")
    ax.set_title(title, loc="left", fontsize=10)
    labels = [n for n in COLOURS if n != "unknown"]
    stall = "stall" if tl.stall_rate is None else f"stall (< {tl.stall_rate:.1f} tok/s)"
    ax.legend(
        handles=[Patch(color=COLOURS[n], label=stall if n == "stall" else n) for n in labels],
        loc="lower right",
        bbox_to_anchor=(1.0, 1.0),
        ncol=len(labels),
        fontsize=8,
    )
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except OSError as exc:
        raise InputError(f"cannot write {path}: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)
