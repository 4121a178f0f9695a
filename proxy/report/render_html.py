"""Renders reports as one self-contained HTML page of tables (`--format html`)."""

from __future__ import annotations

import html
from collections.abc import Sequence

from proxy.report.model import Report
from proxy.report.render import grids, remarks


def to_html(reports: Sequence[Report], names: Sequence[str]) -> str:
    title = html.escape(" vs ".join(r.title for r in reports))
    body = [f"<h2>{title}</h2>"]
    for name, head, rows, note in grids(reports, names):
        body.append(
            f"<h3>{html.escape(name)}</h3><table><tr>"
            + "".join(f"<th>{html.escape(h)}</th>" for h in head)
            + "</tr>"
        )
        body += ["<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows]
        body.append("</table>" + (f"<p class=note>{html.escape(note)}</p>" if note else ""))
    body += [f"<p class=remark>{html.escape(r)}</p>" for r in remarks(reports, names)]
    return (
        f'<!DOCTYPE html><html><head><meta charset="utf-8"><title>{title}</title><style>'
        "body{font:14px sans-serif;margin:16px} table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}"
        "td:first-child,th:first-child{text-align:left} .note{color:#666}"
        "</style></head><body>" + "\n".join(body) + "</body></html>\n"
    )
