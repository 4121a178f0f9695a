"""Writes a timeline as one self-contained HTML page: inline SVG, CSS and script, no network.

Hovering a bar shows the request's figures; the script marks `<body data-timeline-ready="1">`
once it ran, so a headless browser can check the page worked.
"""

from __future__ import annotations

import html
import json

from proxy.report.timeline import Timeline

COLOURS = {
    "wait": "#b0b0b0",
    "fed in pieces": "#c9a8de",
    "prefill": "#4c78a8",
    "long prefill": "#7b3fa0",
    "decode": "#59a14f",
    "unknown": "#e0d9c0",
    "stall": "#e15759",
}
LANE_H, BAR_H, LEFT, TOP = 34, 22, 70, 30


def _x(t: float, scale: float) -> float:
    return LEFT + t * scale


def timeline_html(tl: Timeline, title: str) -> str:
    width = min(24000.0, max(1100.0, tl.duration * 40))
    scale = (width - LEFT - 20) / tl.duration if tl.duration > 0 else 1.0
    height = TOP + tl.lanes * LANE_H + 30
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height}">']
    parts += _axis(tl, scale, height)
    for lane, name in enumerate(tl.lane_names):
        y = TOP + lane * LANE_H
        parts.append(f'<text x="4" y="{y + BAR_H * 0.75:.1f}" class="lane">{html.escape(name)}</text>')
    for bar in tl.bars:
        info = dict(bar.info) | {"phase": bar.phase, "from_s": f"{bar.start:.3f}", "to_s": f"{bar.end:.3f}"}
        parts.append(
            f'<rect class="bar" x="{_x(bar.start, scale):.2f}" y="{TOP + bar.lane * LANE_H}" '
            f'width="{max(0.8, (bar.end - bar.start) * scale):.2f}" height="{BAR_H}" '
            f'fill="{COLOURS[bar.phase]}" data-info="{html.escape(json.dumps(info))}"/>'
        )
    for mark in tl.marks:
        info = {
            "stall": f"{mark.rate:.2f} tok/s",
            "why": mark.why,
            "from_s": f"{mark.start:.3f}",
            "to_s": f"{mark.end:.3f}",
        }
        wide = max(0.8, (mark.end - mark.start) * scale)
        parts.append(
            f'<rect class="bar" x="{_x(mark.start, scale):.2f}" '
            f'y="{TOP + mark.lane * LANE_H + BAR_H - 6}" width="{wide:.2f}" '
            f'height="6" fill="{COLOURS["stall"]}" data-info="{html.escape(json.dumps(info))}"/>'
        )
    parts.append("</svg>")
    return PAGE.format(title=html.escape(title), legend=_legend(tl), svg="\n".join(parts))


def _axis(tl: Timeline, scale: float, height: int) -> list[str]:
    step = next((s for s in (0.5, 1, 2, 5, 10, 30, 60, 300, 600, 1800, 3600, 7200) if s * scale >= 70), 14400)
    lines, t = [], 0.0
    while t <= tl.duration + 1e-9:
        x = _x(t, scale)
        lines.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{TOP - 6}" y2="{height - 24}" class="tick"/>')
        lines.append(f'<text x="{x + 2:.1f}" y="{TOP - 10}" class="tick">{t:g} s</text>')
        t += step
    return lines


def _legend(tl: Timeline) -> str:
    items = [
        f'<span><i style="background:{c}"></i>{html.escape(name)}</span>'
        for name, c in COLOURS.items()
        if name != "unknown"
    ]
    if tl.stall_rate is not None:
        items.append(f"<span>stall = decode below {tl.stall_rate:.1f} tok/s</span>")
    return " ".join(items)


PAGE = """<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font: 13px sans-serif; margin: 12px; }}
#wrap {{ overflow-x: auto; border: 1px solid #ddd; }}
.legend span {{ margin-right: 14px; }}
.legend i {{ display: inline-block; width: 12px; height: 12px; margin-right: 4px;
  vertical-align: middle; }}
text.lane, text.tick {{ font: 11px sans-serif; fill: #333; }}
line.tick {{ stroke: #eee; }}
rect.bar:hover {{ stroke: #000; stroke-width: 1; }}
#tip {{ position: fixed; display: none; background: #fffbe6; border: 1px solid #999;
  padding: 4px 6px; font: 12px monospace; white-space: pre; pointer-events: none; }}
</style></head>
<body data-timeline-ready="0">
<h3>{title}</h3>
<div class="legend">{legend}</div>
<div id="wrap">{svg}</div>
<div id="tip"></div>
<script>
(function () {{
  var tip = document.getElementById("tip");
  var bars = document.querySelectorAll("rect.bar");
  bars.forEach(function (bar) {{
    bar.addEventListener("mousemove", function (ev) {{
      var info = JSON.parse(bar.getAttribute("data-info"));
      tip.textContent = Object.keys(info).map(function (k) {{ return k + ": " + info[k]; }})
        .join("\\n");
      tip.style.left = (ev.clientX + 12) + "px";
      tip.style.top = (ev.clientY + 12) + "px";
      tip.style.display = "block";
    }});
    bar.addEventListener("mouseleave", function () {{ tip.style.display = "none"; }});
  }});
  document.body.setAttribute("data-bars", String(bars.length));
  document.body.setAttribute("data-timeline-ready", "1");
}})();
</script>
</body></html>
"""
