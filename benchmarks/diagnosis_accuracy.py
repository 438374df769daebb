"""Which tool names the cause of a non-finite step: trainguard vs detect_anomaly + hooks.

The cases are issue 55's (tests/support/tg_class_cases.py: guarded runs built from scratch,
their bundles replayed) and, unless ``--quick``, the classic causes of
tests/support/nan_cases.py and a 2-rank DDP run. Two tools:

- **trainguard**: ``tg.replay(bundle, factory)`` of a captured step (without ``--rank``),
  ``tg.diagnose(model, loss_fn, batch, bisect=True)`` of a live one;
- **anomaly + hooks**: ``torch.autograd.detect_anomaly(check_nan=True)`` around forward and
  backward, plus forward hooks and full backward hooks on every module that record the first
  module whose output (or input gradient) is non-finite (fairseq's ``NanDetector``). For a
  bundle it runs the bundle's live objects: its weights, the bad micro-batch of the rank that
  made the NaN (which it would have to guess without a replay).

Each tool is scored on the phase, op, module, source line, culprit sample, and the one
``cause`` fact the case is about (the update's step, group and hyper-parameter; the
non-finite rows; the constant's argument; the masked target; the backward op where the
gradient went NaN; an in-place op's operands as they were). JSON to
``benchmarks/results/cpu/diagnosis_accuracy.json``::

    python benchmarks/diagnosis_accuracy.py --update-docs docs/diagnosis.md
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import re
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "support"))

import nan_cases as nc  # type: ignore[import-not-found]  # noqa: E402
import tg_class_cases as cc  # type: ignore[import-not-found]  # noqa: E402

import trainguard as tg  # noqa: E402

NAME = "diagnosis_accuracy"
OUT = ROOT / "benchmarks" / "results" / "cpu" / f"{NAME}.json"
BLOCK = "diagnosis-accuracy"
FIELDS = ("phase", "op", "module", "line", "sample", "cause")
TOOLS = ("trainguard", "anomaly + hooks")
MARK = {"yes": "✓", "no": "✗", "n/a": "·"}
Named = dict[str, Any]
"""What a tool named: phase, op (names), module, line, sample (``(micro, position)``s), said."""
Objects = tuple[nn.Module, Callable[[nn.Module, Any], Tensor], Any]


@dataclass
class Case:
    name: str
    group: str
    """``issue 55`` or ``classic``."""
    description: str
    expected: dict[str, Any]
    """phase, op (a substring), module, line, sample (``(micro, position)``), verdict."""
    trainguard: Callable[[], tg.ReplayReport]
    objects: Callable[[], Objects]
    """The live objects the other tool runs."""
    cause: Callable[[Named], bool] | None = None
    """Whether a tool's output names the case's cause (None: the case has none to name)."""
    file: str = "tg_class_cases.py"
    extra: dict[str, Any] = field(default_factory=dict)


# -- the tools ------------------------------------------------------------------------------------


def _line_in(text: str | None, file: str) -> int | None:
    found = re.findall(re.escape(file) + r"[\"']?(?:, line |:)(\d+)", text or "")
    return int(found[-1]) if found else None


def run_trainguard(case: Case) -> Named:
    r = case.trainguard().to_dict()
    ops = [r["op"], (r.get("backward") or {}).get("forward_op")]
    return {
        "phase": r["phase"] if r["reproduced"] or r["phase"] else "none",
        "op": [o for o in ops if o],
        "module": r["module"],
        "line": _line_in(r["source"], case.file),
        "sample": [(c["micro_batch"], c["position"]) for c in r["culprit_samples"]],
        "verdict": r["verdict"],
        "report": r,
        "said": f"{r['verdict']}: {r['summary']}",
    }


def _finite(t: Any) -> bool:
    return not isinstance(t, Tensor) or bool(torch.isfinite(t.detach()).all())


def run_anomaly(case: Case) -> Named:
    model, loss_fn, batch = case.objects()
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
                    loss.backward()  # type: ignore[no-untyped-call]
                except RuntimeError as exc:
                    error = str(exc)
        trace = "\n".join(str(w.message) for w in caught if "Traceback" in str(w.message))
    finally:
        for handle in handles:
            handle.remove()
    function = re.search(r"Function '(\w+)' returned nan", error or "")
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
        "op": [function.group(1)] if function else [],
        "module": module if module != "(model)" else None,
        "line": _line_in(trace, case.file) if error else None,
        "sample": [],
        "verdict": None,
        "said": said.splitlines()[0],
    }


RUNNERS: dict[str, Callable[[Case], Named]] = {
    "trainguard": run_trainguard,
    "anomaly + hooks": run_anomaly,
}


def _safe(runner: Callable[[Case], Named], case: Case) -> Named:
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
            "verdict": None,
            "said": f"{type(exc).__name__}: {first}"[:200],
        }


# -- scoring ---------------------------------------------------------------------------------------


def _yes(ok: bool) -> str:
    return "yes" if ok else "no"


def score(case: Case, named: Named) -> dict[str, str]:
    want = case.expected
    out = {"phase": _yes(named["phase"] == want["phase"])}
    op = want.get("op")
    out["op"] = "n/a" if op is None else _yes(any(op in o.lower() for o in named["op"]))
    module = want.get("module")
    out["module"] = "n/a" if module is None else _yes(named["module"] == module)
    line = want.get("line")
    out["line"] = "n/a" if line is None else _yes(named["line"] == line)
    sample = want.get("sample")
    out["sample"] = "n/a" if sample is None else _yes(named["sample"] == [sample])
    out["cause"] = "n/a" if case.cause is None else _yes(case.cause(named))
    return out


# -- the cases -------------------------------------------------------------------------------------


def _report(named: Named) -> dict[str, Any]:
    report: dict[str, Any] = named.get("report") or {}
    return report


def _bundle_objects(bundle: Path, factory: Callable[[], Any], rank: int, micro: int) -> Objects:
    opened = tg.load_bundle(bundle)
    model, loss_fn = factory()
    model.load_state_dict(opened.model_state(rank))
    model.train(bool(opened.meta(rank).get("model_training", True)))
    return model, loss_fn, opened.batches(rank)[micro]


def _replayed(bundle: Path, factory: Callable[[], Any]) -> Callable[[], tg.ReplayReport]:
    return lambda: tg.replay(bundle, factory)


def _hyper_named(named: Named) -> bool:
    r = _report(named)
    writer = (r.get("weights") or {}).get("writer") or {}
    hypers = r.get("hyperparameters") or writer.get("hyperparameters") or []
    return {"group": 1, "name": "lr", "value": "nan"} in hypers and "at step 3" in r["summary"]


def _rows_named(named: Named) -> bool:
    weights = _report(named).get("weights") or {}
    rows = (weights.get("rows") or {}).get("rows")
    return rows == list(range(8, 16)) and (weights.get("updates") or {}).get("status") == "never"


def _constant_named(named: Named) -> bool:
    return str(_report(named).get("constant") or "").endswith("weight")


def _target_named(named: Named) -> bool:
    read = _report(named).get("masked_read") or {}
    position = read.get("position") or [None]
    return bool(position[0] == 2 * cc.POSITIONS + 3)


def _gradient_named(named: Named) -> bool:
    grad = _report(named).get("gradient_op") or {}
    return grad.get("grad_fn") == "DivBackward0" or "DivBackward0" in str(named["op"])


def _operands_named(named: Named) -> bool:
    return str(_report(named).get("op_detail") or "").startswith("aten.div_(0.0, 0.0)")


def _expect(phase: str, op: str | None, module: str | None, line: str | None, **kw: Any) -> Any:
    return {
        "phase": phase,
        "op": op,
        "module": module,
        "line": cc.root_line(line) if line else None,
        **kw,
    }


def issue_cases(work: Path) -> list[Case]:
    """Issue 55's classes, each a guarded run of its own whose bundle is replayed."""
    warm = cc.group_warmup_run(work / "warmup")
    (rows,) = cc.grown_table_run(work / "rows", long=(5,))
    (weights,) = cc.class_weight_run(work / "weights", rare=6)
    (schema,) = cc.schema_run(work / "schema", bad=(1, 2, 3))
    (soft,) = cc.softmax_run(work / "softmax", bad=(2, 5))
    x = torch.randn(cc.BATCH, 5, generator=torch.Generator().manual_seed(3))
    x[4] = 0.0
    y = torch.arange(cc.BATCH) % 3

    def in_place_loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
        return nn.functional.cross_entropy(model(batch[0]), batch[1])

    return [
        Case(
            "hyper_lr_stopped",
            "1a",
            "a group's warm-up divides by zero: lr nan at step 3 (the guard stopped the step)",
            _expect("optimizer", None, None, None, verdict="nonfinite_hyperparameter"),
            _replayed(warm[0], cc.two_group_factory),
            lambda: _bundle_objects(warm[0], cc.two_group_factory, 0, 0),
            _hyper_named,
        ),
        Case(
            "hyper_lr_written",
            "1a",
            "the same lr, applied anyway (warn): step 3's update wrote NaN into the head",
            _expect("forward", None, "head", None, verdict="nonfinite_hyperparameter"),
            _replayed(warm[1], cc.two_group_factory),
            lambda: _bundle_objects(warm[1], cc.two_group_factory, 0, 0),
            _hyper_named,
        ),
        Case(
            "grown_table_rows",
            "1b",
            "a position table grown by copying chunks, tail never initialised; one long sequence",
            _expect("forward", "embedding", "pos", "grown_table_rows", sample=(0, 5)),
            _replayed(rows, cc.position_factory),
            lambda: _bundle_objects(rows, cc.position_factory, 0, 0),
            _rows_named,
            extra={"verdict": "nonfinite_rows"},
        ),
        Case(
            "class_weights",
            "2",
            "CrossEntropyLoss(weight=...) estimated on labels that lacked class 3 (inf)",
            _expect("loss", "nll_loss", "CrossEntropyLoss", "class_weights", sample=(0, 6)),
            _replayed(weights, cc.weighted_factory),
            lambda: _bundle_objects(weights, cc.weighted_factory, 0, 0),
            _constant_named,
            extra={"verdict": "nonfinite_constant"},
        ),
        Case(
            "masked_target",
            "3",
            "logits masked to a schema's tokens; one target is a forbidden token (2 micro-batches)",
            _expect("loss", "nll_loss", None, "masked_target", sample=(1, 2)),
            _replayed(schema, cc.schema_factory),
            lambda: _bundle_objects(schema, cc.schema_factory, 0, 1),
            _target_named,
            extra={"verdict": "masked_position"},
        ),
        Case(
            "hidden_overflow",
            "4",
            "exp / sum by hand: exp overflows in a class the loss never reads; NaN gradient",
            _expect("forward", "exp", "softmax", "hidden_overflow", sample=(0, 5)),
            _replayed(soft, cc.softmax_factory),
            lambda: _bundle_objects(soft, cc.softmax_factory, 0, 0),
            _gradient_named,
            extra={"verdict": "numerical"},
        ),
        Case(
            "in_place",
            "5",
            "an in-place division by a zero sum (0/0): operands as they were",
            _expect("forward", "div_", "InPlaceNorm", "in_place", sample=(0, 4)),
            lambda: tg.diagnose(cc.InPlaceNorm(), in_place_loss, (x, y), bisect=True),
            lambda: (cc.InPlaceNorm(), in_place_loss, (x, y)),
            _operands_named,
            extra={"verdict": "numerical"},
        ),
    ]


def _verdicts(cases: list[Case]) -> list[Case]:
    for case in cases:
        case.expected.setdefault("verdict", case.extra.get("verdict"))
    return cases


def two_rank_case(work: Path) -> Case:
    """Class 4 on 2 DDP ranks with 2 micro-batches a step: rank 1's micro-batch 1."""
    from tg_dist import run_ranks, values  # type: ignore[import-not-found]

    soft, rows = work / "dist-softmax", work / "dist-rows"
    values(run_ranks(cc.dist_worker, 2, str(soft), str(rows), timeout=150))
    (bundle,) = cc.captures(soft)
    return Case(
        "hidden_overflow_ddp",
        "4",
        "the same on rank 1 of 2 DDP ranks, micro-batch 1 of 2; the all-reduce spreads the NaN",
        _expect("forward", "exp", "softmax", "hidden_overflow", sample=(1, 5), verdict="numerical"),
        _replayed(bundle, cc.softmax_factory),
        lambda: _bundle_objects(bundle, cc.softmax_factory, 1, 1),
        _gradient_named,
    )


def classic_cases() -> list[Case]:
    """tests/support/nan_cases.py's classic causes, diagnosed live."""
    out = []
    for case in nc.CASES:
        history = nc.diverging_run()[3] if case.name == "divergence" else None
        line = nc.root_line(case.name) if case.line else None
        expected = {
            "phase": case.phase,
            "op": case.op,
            "module": case.module,
            "line": line,
            "sample": (0, case.sample) if case.sample is not None else None,
            "verdict": case.verdict,
        }

        def diagnose(case: Any = case, history: Any = history) -> tg.ReplayReport:
            model, loss_fn, batch = case.build()
            return tg.diagnose(model, loss_fn, batch, bisect=True, history=history)

        out.append(
            Case(
                case.name,
                "classic",
                case.description,
                expected,
                diagnose,
                case.build,
                None,
                "nan_cases.py",
            )
        )
    return out


# -- the run and the table ------------------------------------------------------------------------


def run_case(case: Case) -> dict[str, Any]:
    tools = {}
    for tool, runner in RUNNERS.items():
        start = time.perf_counter()
        named = _safe(runner, case)
        seconds = time.perf_counter() - start
        shown = {k: v for k, v in named.items() if k != "report"}
        tools[tool] = {"named": shown, "score": score(case, named), "seconds": round(seconds, 3)}
    return {
        "case": case.name,
        "class": case.group,
        "description": case.description,
        "expected": case.expected,
        "tools": tools,
    }


def table(rows: list[dict[str, Any]]) -> str:
    head = "| case | class | " + " | ".join(TOOLS) + " | verdict |"
    lines = [
        "Each cell: phase, op, module, line, sample, cause (✓ named right, ✗ wrong or not "
        "named, · the case has none).",
        "",
        head,
        "|" + "---|" * (len(TOOLS) + 3),
    ]
    totals = {tool: [0, 0] for tool in TOOLS}
    right = 0
    for row in rows:
        cells = []
        for tool in TOOLS:
            marks = row["tools"][tool]["score"]
            cells.append(" ".join(MARK[marks[f]] for f in FIELDS))
            totals[tool][0] += sum(marks[f] == "yes" for f in FIELDS)
            totals[tool][1] += sum(marks[f] != "n/a" for f in FIELDS)
        verdict = row["tools"]["trainguard"]["named"].get("verdict")
        ok = verdict == row["expected"].get("verdict")
        right += ok
        lines.append(
            f"| `{row['case']}` | {row['class']} | "
            + " | ".join(cells)
            + f" | `{verdict}` "
            + ("✓" if ok else "✗")
            + " |"
        )
    lines.append(
        "| **named right** | | "
        + " | ".join(f"**{a} of {b}**" for a, b in (totals[t] for t in TOOLS))
        + f" | **{right} of {len(rows)}** |"
    )
    return "\n".join(lines)


def _commit() -> str | None:
    try:
        done = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        )
    except OSError:
        return None
    return done.stdout.strip() or None


def replace_block(page: Path, text: str) -> None:
    """Put ``text`` between the page's ``<!-- diagnosis-accuracy:begin/end -->`` markers."""
    source = page.read_text(encoding="utf-8")
    begin, end = f"<!-- {BLOCK}:begin -->", f"<!-- {BLOCK}:end -->"
    if begin not in source or end not in source:
        raise SystemExit(f"{page}: no {begin} ... {end} block")
    head, rest = source.split(begin, 1)
    _, tail = rest.split(end, 1)
    page.write_text(f"{head}{begin}\n{text}\n{end}{tail}", encoding="utf-8")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="issue 55's cases only, one rank")
    parser.add_argument("--out", type=Path, default=OUT, help="where the JSON goes")
    parser.add_argument("--update-docs", type=Path, metavar="PAGE", help="e.g. docs/diagnosis.md")
    args = parser.parse_args(argv)
    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        cases = _verdicts(issue_cases(work))
        if not args.quick:
            cases += [two_rank_case(work), *classic_cases()]
        rows = [run_case(case) for case in cases]
    text = table(rows)
    print(text)
    report = {
        "benchmark": NAME,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "commit": _commit(),
        "command": " ".join(["python", *sys.argv]),
        "settings": {"quick": args.quick, "threads": 1},
        "machine": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "platform": platform.platform(),
            "cpu": platform.processor() or platform.machine(),
        },
        "seconds": round(time.perf_counter() - start, 1),
        "rows": rows,
        "table": text,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1, default=str) + "\n", encoding="utf-8")
    if args.update_docs is not None:
        replace_block(args.update_docs, text)
        print(f"updated {args.update_docs}", file=sys.stderr)


if __name__ == "__main__":
    main()
