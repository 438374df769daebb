"""``trainguard report RUN_DIR``: what the command does (cli.py only parses the arguments)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from trainguard.events import to_jsonable
from trainguard.report.html import write_html
from trainguard.report.runs import ALL
from trainguard.report.summary import RunSummary, UnknownRun, summarize, summarize_all
from trainguard.report.text import report_text, runs_text

EXIT_OK = 0
EXIT_USAGE = 2
PAGE = "report.html"


def run_report(
    run_dir: Path,
    *,
    as_json: bool,
    png: Path | None,
    html: bool,
    run: str | None = None,
    list_runs: bool = False,
) -> int:
    """Print the summary of one run (``run``: its id, None the latest, ``all`` every run),
    write ``RUN_DIR/report.html`` (and ``png``); or, with ``list_runs``, list the runs."""
    if not run_dir.is_dir():
        return _fail(f"{run_dir}: no such directory")
    if list_runs:
        run = None  # the listing marks the latest run: the one shown by default
    try:
        summaries = summarize_all(run_dir) if run == ALL else [summarize(run_dir, run)]
    except UnknownRun as exc:
        return _fail(str(exc))
    if all(s.empty for s in summaries):
        return _fail(
            f"{run_dir}: nothing to report (no readable events, metrics, captures or hangs; "
            "is it a trainguard run_dir?)"
        )
    if list_runs:
        return _print_runs(summaries[0], as_json)
    if png is not None and len(summaries) > 1:
        return _fail("--png draws one run: pick it with --run ID (default: the latest)")
    page = _write_page(summaries, run_dir / PAGE) if html else None
    if png is not None:
        try:
            from trainguard.report.plot import write_png

            write_png(summaries[0], png)
        except ImportError:
            return _fail("--png needs matplotlib: pip install 'trainguard[plot]'")
    if as_json:
        if run == ALL:
            runs = summaries[0].runs
            reports = [{**s.to_dict(), "runs": None} for s in summaries]
            data = {"run_dir": str(run_dir), "run": ALL, "runs": runs, "reports": reports}
        else:
            data = summaries[0].to_dict()
        print(json.dumps(to_jsonable({**data, "page": page}), allow_nan=False))
    else:
        print("\n\n".join(report_text(s, page) for s in summaries))
    return EXIT_OK


def _print_runs(summary: RunSummary, as_json: bool) -> int:
    """``--runs``: the runs of the directory, oldest first; the latest is shown by default."""
    latest = summary.run
    if as_json:
        data = {"run_dir": summary.run_dir, "runs": summary.runs, "latest": latest}
        print(json.dumps(to_jsonable(data), allow_nan=False))
    elif not summary.runs:
        print(f"trainguard report: {summary.run_dir}: no events, so no run ids")
    else:
        print(runs_text(summary.run_dir, summary.runs, latest))
    return EXIT_OK


def _write_page(summaries: list[RunSummary], path: Path) -> str | None:
    try:
        write_html(summaries, path)
    except OSError as exc:
        print(f"trainguard: report: cannot write {path}: {exc}", file=sys.stderr)
        return None
    return str(path)


def _fail(message: str) -> int:
    print(f"trainguard: report: {message}", file=sys.stderr)
    return EXIT_USAGE
