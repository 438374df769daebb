"""``RUN_DIR/report.html``: one self-contained page (no network: the picture is inline)."""

from __future__ import annotations

import base64
import html
from collections.abc import Sequence
from pathlib import Path

from trainguard.report.plot import plot_available, png_bytes
from trainguard.report.summary import RunSummary
from trainguard.report.text import report_text

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 24px; color: #222; max-width: 1120px; }
h1 { font-size: 20px; margin: 0 0 4px 0; }
.sub { color: #666; font-size: 13px; margin-bottom: 16px; }
.cards { display: flex; gap: 12px; flex-wrap: wrap; margin-bottom: 16px; }
.card { border: 1px solid #ddd; border-radius: 6px; padding: 8px 14px; min-width: 110px; }
.card b { display: block; font-size: 20px; }
.card.bad b { color: #d62728; }
img { max-width: 100%; border: 1px solid #eee; }
pre { background: #f6f6f6; padding: 12px; font-size: 12px; white-space: pre-wrap; }
.note { background: #fff6e0; border: 1px solid #f0d080; padding: 8px 12px; }
"""


def report_html(summary: RunSummary | Sequence[RunSummary]) -> str:
    """The page: headline numbers, the timeline (when matplotlib is there) and the summary;
    for several runs (``--run all``) one such section per run, oldest first."""
    summaries = [summary] if isinstance(summary, RunSummary) else list(summary)
    title = f"trainguard report: {summaries[0].run_dir}"
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}</title><style>{_STYLE}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
    ]
    for one in summaries:
        if len(summaries) > 1:
            parts.append(f"<h2>Run {html.escape(str(one.run))}</h2>")
        parts += [
            f'<div class="sub">{_subtitle(one)}</div>',
            _cards(one),
            _picture(one),
            "<h2>Summary</h2>",
            f"<pre>{html.escape(report_text(one))}</pre>",
        ]
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def write_html(summary: RunSummary | Sequence[RunSummary], path: Path) -> Path:
    path.write_text(report_html(summary), encoding="utf-8")
    return path


def _subtitle(summary: RunSummary) -> str:
    ranks = f"{summary.world_size} ranks, " if summary.world_size else ""
    run = f"run {summary.run}: " if summary.run is not None else ""
    return html.escape(f"{run}{ranks}{summary.steps} steps, {summary.events} events read")


def _cards(summary: RunSummary) -> str:
    bad_steps = sum(n for kind, n in summary.decisions.items() if kind != "ok")
    named = [e for e in summary.stragglers if e.get("ranks")]
    cards = [
        ("steps", summary.steps, False),
        ("non-finite steps", len(summary.nonfinite), bool(summary.nonfinite)),
        ("other bad steps", bad_steps - len(summary.nonfinite), False),
        ("captures", len(summary.captures), False),
        ("spikes", len(summary.spikes), bool(summary.spikes)),
        ("rollbacks", len(summary.rollbacks), False),
        ("hangs", len(summary.hangs), bool(summary.hangs)),
        *([("ranks ended by a signal", len(summary.crashes), True)] if summary.crashes else []),
        ("straggler verdicts", len(named), bool(named)),
    ]
    cells = [
        f'<div class="card{" bad" if bad else ""}"><b>{value}</b>{html.escape(label)}</div>'
        for label, value, bad in cards
    ]
    return '<div class="cards">' + "".join(cells) + "</div>"


def _picture(summary: RunSummary) -> str:
    if not plot_available():
        return (
            '<p class="note">No timeline: matplotlib is not installed '
            "(<code>pip install 'trainguard[plot]'</code>).</p>"
        )
    if not (summary.points or summary.nonfinite or summary.hangs or summary.stragglers):
        return '<p class="note">No timeline: the run has no per-step metrics.</p>'
    data = base64.b64encode(png_bytes(summary)).decode("ascii")
    alt = "timeline: loss, gradient norm, non-finite ranks, stragglers"
    return f'<img alt="{alt}" src="data:image/png;base64,{data}">'
