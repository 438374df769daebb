"""``trainguard report RUN_DIR``: what the command does (cli.py only parses the arguments)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from trainguard.events import to_jsonable
from trainguard.report.html import write_html
from trainguard.report.plot import plot_available, write_png
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
    problem = _usage_problem(run_dir, png, run, list_runs)
    if problem is not None:
        return _fail(problem)
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
    if png is not None and not plot_available():
        return _fail("--png needs matplotlib: pip install 'trainguard[plot]'")
    page = _write_page(summaries, run_dir / PAGE) if html else None
    _print_summaries(summaries, run_dir, run, as_json, page)
    return _write_png(summaries[0], png) if png is not None else EXIT_OK


def _usage_problem(run_dir: Path, png: Path | None, run: str | None, list_runs: bool) -> str | None:
    """What is wrong with the arguments before anything is read (None: nothing)."""
    if run_dir.exists() and not run_dir.is_dir():
        return (
            f"{run_dir} is a file, not a run directory: give the Guard's run_dir (the folder "
            "holding events/ and metrics/)"
        )
    if not run_dir.is_dir():
        return f"{run_dir}: no such directory"
    if list_runs and (png is not None or run is not None):
        option = "--png" if png is not None else "--run"
        return f"--runs lists the runs and draws nothing: drop {option} (or drop --runs)"
    return None


def _print_summaries(
    summaries: list[RunSummary], run_dir: Path, run: str | None, as_json: bool, page: str | None
) -> None:
    if not as_json:
        print("\n\n".join(report_text(s, page) for s in summaries))
        return
    if run == ALL:
        runs = summaries[0].runs
        reports = [{**s.to_dict(), "runs": None} for s in summaries]
        data = {"run_dir": str(run_dir), "run": ALL, "runs": runs, "reports": reports}
    else:
        data = summaries[0].to_dict()
    print(json.dumps(to_jsonable({**data, "page": page}), allow_nan=False))


def _write_png(summary: RunSummary, png: Path) -> int:
    """Draw the timeline to ``png`` (after the summary is printed: a bad path costs only the
    picture); a path that cannot be written is one line naming ``--png``."""
    sys.stdout.flush()  # the summary first, then the error line
    try:
        write_png(summary, png)
    except OSError as exc:
        return _fail(
            f"--png {png}: cannot write the picture ({_why(png, exc)}); give a file path "
            "whose folders exist or can be made, e.g. --png timeline.png"
        )
    return EXIT_OK


def _why(png: Path, exc: OSError) -> str:
    if png.is_dir():
        return "it is a directory"
    blocked = next((p for p in png.parents if p.exists() and not p.is_dir()), None)
    if blocked is not None:
        return f"{blocked} is a file, not a folder"
    return exc.strerror or str(exc)


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
