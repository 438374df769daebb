"""``trainguard report RUN_DIR``: what the command does (cli.py only parses the arguments)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from trainguard.events import to_jsonable
from trainguard.report.html import write_html
from trainguard.report.summary import RunSummary, summarize
from trainguard.report.text import report_text

EXIT_OK = 0
EXIT_USAGE = 2
PAGE = "report.html"


def run_report(run_dir: Path, *, as_json: bool, png: Path | None, html: bool) -> int:
    """Print the summary, write ``RUN_DIR/report.html`` (and ``png``); exit code."""
    if not run_dir.is_dir():
        return _fail(f"{run_dir}: no such directory")
    summary = summarize(run_dir)
    if summary.empty:
        return _fail(
            f"{run_dir}: nothing to report (no readable events, metrics, captures or hangs; "
            "is it a trainguard run_dir?)"
        )
    page = _write_page(summary, run_dir / PAGE) if html else None
    if png is not None:
        try:
            from trainguard.report.plot import write_png

            write_png(summary, png)
        except ImportError:
            return _fail("--png needs matplotlib: pip install 'trainguard[plot]'")
    if as_json:
        data = {**summary.to_dict(), "page": page}
        print(json.dumps(to_jsonable(data), allow_nan=False))
    else:
        print(report_text(summary, page))
    return EXIT_OK


def _write_page(summary: RunSummary, path: Path) -> str | None:
    try:
        write_html(summary, path)
    except OSError as exc:
        print(f"trainguard: report: cannot write {path}: {exc}", file=sys.stderr)
        return None
    return str(path)


def _fail(message: str) -> int:
    print(f"trainguard: report: {message}", file=sys.stderr)
    return EXIT_USAGE
