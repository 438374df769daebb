"""Which tool names the cause of a non-finite step: trainguard vs detect_anomaly vs sherlorch.

Runs every case of tests/support/nan_cases.py (15 classic causes) plus four real captures of
guarded runs, replayed (_diagnosis_bundles.py: a one-off fault, a float16 overflow under
the loop's autocast, a backward NaN on rank 1 of a 2-rank DDP run, replicas that differ),
under three tools:

- **trainguard**: ``tg.diagnose(model, loss_fn, batch, bisect=True)`` (the bundle replay's
  engine; the divergence case gets the run's history, as a bundle carries it), and
  ``tg.replay`` of the captured bundle for the bundle cases;
- **anomaly + hooks**: ``torch.autograd.detect_anomaly(check_nan=True)`` around forward and
  backward, plus forward hooks and full backward hooks on every module that record the first
  module whose output (forward) or input gradient (backward) is non-finite: the approach of
  fairseq's ``NanDetector``;
- **sherlorch** 0.1.0: ``sherlorch.trace(capture_stack=True)`` with ``tracker.watch(model)``,
  then ``tracker.diagnose(loss)`` (or of the first non-finite gradient).

For each case it records whether the tool names the right phase, op, module, source line and
culprit sample (``n/a`` where the case has none), writes JSON and renders the table::

    python benchmarks/diagnosis_suite.py --out benchmarks/results/diagnosis.json \\
        --update-docs docs/diagnosis.md
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _common import replace_block
from torch import Tensor, nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "support"))

import _diagnosis_bundles as bundles  # noqa: E402
import nan_cases as nc  # type: ignore[import-not-found]  # noqa: E402

import trainguard as tg  # noqa: E402
from trainguard.replay.report import ReplayReport  # noqa: E402

DOCS_BLOCK = "diagnosis-table"
FIELDS = ("phase", "op", "module", "line", "sample")
TOOLS = ("trainguard", "anomaly + hooks", "sherlorch")
Named = dict[str, Any]
"""What a tool named: phase, op (list of names), module, line (int), sample (list)."""


def _finite(t: Any) -> bool:
    return not isinstance(t, Tensor) or bool(torch.isfinite(t.detach()).all())


def _file(case: Any) -> str:
    """The source file the case's expected line is in."""
    return str(case.extra.get("file", "nan_cases.py"))


def _line_in(text: str | None, file: str) -> int | None:
    found = re.findall(re.escape(file) + r"[\"']?(?:, line |:)(\d+)", text or "")
    return int(found[-1]) if found else None


# -- the tools ----------------------------------------------------------------------------------


def run_trainguard(case: Any) -> Named:
    model, loss_fn, batch = case.build()
    history = nc.diverging_run()[3] if case.name == "divergence" else None
    return trainguard_named(tg.diagnose(model, loss_fn, batch, bisect=True, history=history), case)


def trainguard_named(report: ReplayReport, case: Any) -> Named:
    """What a trainguard report names (a live diagnosis or a bundle replay)."""
    r = report.to_dict()
    ops = [r["op"], (r.get("backward") or {}).get("forward_op")]
    rank = f" (rank {r['rank']})" if "rank" in r else ""
    return {
        "phase": r["phase"] if r["reproduced"] else "none",
        "op": [o for o in ops if o],
        "module": r["module"],
        "line": _line_in(r["source"], _file(case)),
        "sample": [c["position"] for c in r["culprit_samples"]],
        "verdict": r["verdict"],
        "said": f"{r['verdict']}{rank}: {r['summary']}",
    }


def run_anomaly(case: Any) -> Named:
    model, loss_fn, batch = case.build()
    names = {m: name or "(model)" for name, m in model.named_modules()}
    forward_bad: list[str] = []
    backward_bad: list[str] = []

    def forward_hook(module: nn.Module, args: Any, out: Any) -> None:
        if not forward_bad and not _finite(out):
            forward_bad.append(names[module])

    def backward_hook(module: nn.Module, grad_in: Any, grad_out: Any) -> None:
        if not backward_bad and not all(_finite(g) for g in grad_in if g is not None):
            backward_bad.append(names[module])

    handles = [m.register_forward_hook(forward_hook) for m in model.modules()]
    handles += [m.register_full_backward_hook(backward_hook) for m in model.modules()]
    error, trace = None, ""
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torch.autograd.detect_anomaly(check_nan=True):
                loss = loss_fn(model, batch)
                try:
                    loss.backward()
                except RuntimeError as exc:
                    error = str(exc)
        trace = "\n".join(str(w.message) for w in caught if "Traceback" in str(w.message))
    finally:
        for handle in handles:
            handle.remove()
    function = re.search(r"Function '(\w+)' returned nan", error or "")
    op = [function.group(1)] if function else []
    if forward_bad:
        phase, module = "forward", forward_bad[0]
    elif not _finite(loss):
        phase, module = "loss", None
    elif error or backward_bad:
        phase, module = "backward", backward_bad[0] if backward_bad else None
    else:
        phase, module = "none", None
    said = f"first non-finite module output: {forward_bad[:1] or '-'}; anomaly: {error or '-'}"
    return {
        "phase": phase,
        "op": op,
        "module": module if module != "(model)" else None,
        "line": _line_in(trace, _file(case)) if error else None,
        "sample": [],
        "said": said.splitlines()[0],
    }


def run_sherlorch(case: Any) -> Named:
    import sherlorch  # type: ignore[import-not-found]

    model, loss_fn, batch = case.build()
    with sherlorch.trace(capture_stack=True) as tracker:
        tracker.watch(model, name="model")
        loss = loss_fn(model, batch)
        loss.backward()
    target, phase = None, "none"
    if not _finite(loss):
        target = loss
    else:
        target = next((p.grad for p in model.parameters() if not _finite(p.grad)), None)
    culprit, said = None, "no non-finite value"
    if target is not None:
        try:
            report = tracker.diagnose(target)
            culprit = report.culprits[0] if report.culprits else None
            lines = [line.strip() for line in str(report).splitlines() if "Culprit #1" in line]
            said = lines[0] if lines else str(report).splitlines()[0]
        except KeyError as exc:
            said = f"KeyError: {exc}"
    if culprit is not None:
        module = (culprit.module_path or "").removeprefix("model").lstrip(".") or None
        phase = "backward" if target is not loss else ("forward" if module else "loss")
        return {
            "phase": phase,
            "op": [culprit.op_name],
            "module": module,
            "line": _line_in(culprit.location, _file(case)),
            "sample": [],
            "said": said,
        }
    return {"phase": phase, "op": [], "module": None, "line": None, "sample": [], "said": said}


# -- scoring ------------------------------------------------------------------------------------


ALIASES = {"addmm": ("linear",)}
"""The same op named at the torch-function level (sherlorch) instead of the aten level."""


def _expected_line(case: Any) -> int | None:
    if not case.line:
        return None
    return int(case.extra["line"]) if "line" in case.extra else int(nc.root_line(case.name))


def score(case: Any, named: Named) -> dict[str, str]:
    expected_line = _expected_line(case)
    out = {"phase": "yes" if named["phase"] == case.phase else "no"}
    if case.op is None:
        out["op"] = "n/a"
    else:
        names = (case.op, *ALIASES.get(case.op, ()))
        out["op"] = _yes(any(n in op.lower() for n in names for op in named["op"]))
    out["module"] = "n/a" if case.module is None else _yes(named["module"] == case.module)
    out["line"] = "n/a" if expected_line is None else _yes(named["line"] == expected_line)
    out["sample"] = "n/a" if case.sample is None else _yes(named["sample"] == [case.sample])
    return out


def _yes(ok: bool) -> str:
    return "yes" if ok else "no"


RUNNERS: dict[str, Callable[[Any], Named]] = {
    "trainguard": run_trainguard,
    "anomaly + hooks": run_anomaly,
    "sherlorch": run_sherlorch,
}


def _safe(runner: Callable[[Any], Named], case: Any) -> Named:
    try:
        return runner(case)
    except Exception as exc:  # a tool that crashes names nothing
        first = str(exc).splitlines()[0] if str(exc) else ""
        return {
            "phase": "error",
            "op": [],
            "module": None,
            "line": None,
            "sample": [],
            "said": f"{type(exc).__name__}: {first}"[:200],
        }


def run_suite() -> list[dict[str, Any]]:
    rows = []
    for case in nc.CASES:
        tools = {}
        for tool, runner in RUNNERS.items():
            named = _safe(runner, case)
            tools[tool] = {"named": named, "score": score(case, named)}
        rows.append(_row(case, tools))
    rows.extend(_bundle_row(row) for row in bundles.bundle_rows())
    return rows


def _row(case: Any, tools: dict[str, Any]) -> dict[str, Any]:
    return {
        "case": case.name,
        "description": case.description,
        "expected": _expected(case),
        "tools": tools,
    }


def _expected(case: Any) -> dict[str, Any]:
    return {
        "phase": case.phase,
        "op": case.op,
        "module": case.module,
        "line": _expected_line(case),
        "sample": case.sample,
        "verdict": case.verdict,
        **({"rank": case.extra["rank"]} if "rank" in case.extra else {}),
    }


def _bundle_row(made: bundles.BundleRow) -> dict[str, Any]:
    """A captured bundle: trainguard replays it; the other tools run its live objects."""
    tools = {}
    for tool, runner in RUNNERS.items():
        if tool == "trainguard":
            named = trainguard_named(made.report, made.case)
        else:
            named = _safe(runner, made.case)
        tools[tool] = {"named": named, "score": score(made.case, named)}
    return _row(made.case, tools)


# -- the table ----------------------------------------------------------------------------------

MARK = {"yes": "✓", "no": "✗", "n/a": "·"}


def table(rows: list[dict[str, Any]]) -> str:
    head = "| case | " + " | ".join(TOOLS) + " |"
    lines = [
        "Each cell: phase, op, module, line, sample (✓ named right, ✗ wrong or not "
        "named, · the case has none).",
        "",
        head,
        "|" + "---|" * (len(TOOLS) + 1),
    ]
    totals = {tool: [0, 0] for tool in TOOLS}
    for row in rows:
        cells = []
        for tool in TOOLS:
            marks = row["tools"][tool]["score"]
            cells.append(" ".join(MARK[marks[f]] for f in FIELDS))
            totals[tool][0] += sum(marks[f] == "yes" for f in FIELDS)
            totals[tool][1] += sum(marks[f] != "n/a" for f in FIELDS)
        lines.append(f"| `{row['case']}` | " + " | ".join(cells) + " |")
    lines.append(
        "| **named right** | "
        + " | ".join(f"**{a} of {b}**" for a, b in (totals[t] for t in TOOLS))
        + " |"
    )
    right = sum(
        row["tools"]["trainguard"]["named"].get("verdict") == row["expected"].get("verdict")
        for row in rows
    )
    lines += [
        "",
        f"trainguard's verdict (the kind of problem) was right in {right} of "
        f"{len(rows)} cases; the other tools have no such output.",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--update-docs", type=Path, metavar="PAGE", help="e.g. docs/diagnosis.md")
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")
    rows = run_suite()
    meta = {
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "sherlorch": _version("sherlorch"),
        "cases": len(rows),
    }
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))
    text = table(rows)
    print(text)
    if args.update_docs is not None:
        replace_block(args.update_docs, DOCS_BLOCK, text)
        print(f"updated {args.update_docs}", file=sys.stderr)


def _version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    main()
