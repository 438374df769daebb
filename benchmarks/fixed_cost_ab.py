"""A/B of the guard's fixed cost between two source trees, in alternating processes.

``fixed_cost.py`` compares modes inside one process (the same machine moment for each); two
versions of trainguard cannot share a process, so this runs ``fixed_cost.py`` in pairs of
processes, the ``before`` tree and the ``after`` tree (``PYTHONPATH``) in alternating order,
and reports per run and as medians over the runs: ``guard_check``'s fixed cost (us per step
over the bare loop of the same process), its ratio to bare and the ``minimal`` floor's. A
tree is a folder holding ``trainguard`` (a checkout's ``src``, or ``git archive`` of one).

    git archive cd23712 src | tar -x -C /tmp/before
    python benchmarks/fixed_cost_ab.py --before /tmp/before/src --after src --pairs 4
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_info, markdown_table, median, now_iso, write_json

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "results" / "cpu" / "fixed_cost_ab.json"
FIELDS = ("guard_check", "guard_step", "minimal")


def run_once(tree: Path, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """One ``fixed_cost.py`` process on ``tree``; its modes' summary."""
    command = [sys.executable, str(HERE / "fixed_cost.py"), "--no-breakdown", "--out", str(out)]
    command += ["--rounds", str(args.rounds)]
    if args.steps is not None:
        command += ["--steps", str(args.steps), "--warmup", "1"]
    if args.pin is not None:
        command += ["--pin", str(args.pin)]
    env = dict(os.environ, PYTHONPATH=str(tree.resolve()))
    subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL)
    report = json.loads(out.read_text(encoding="utf-8"))
    modes: dict[str, Any] = report["modes"]
    return {
        mode: {
            "fixed_cost_us": modes[mode].get("fixed_cost_us"),
            "ratio": modes[mode].get("ratio"),
            "bare_us": modes["bare"]["median_us"],
        }
        for mode in FIELDS
    }


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    return {
        label: {
            mode: {
                "fixed_cost_us": median([r[mode]["fixed_cost_us"] for r in entries]),
                "ratio": median([r[mode]["ratio"] for r in entries]),
            }
            for mode in FIELDS
        }
        for label, entries in runs.items()
    }


def table(summary: dict[str, Any]) -> str:
    rows = [
        [label]
        + [round(summary[label][m]["fixed_cost_us"], 1) for m in FIELDS]
        + [round(summary[label][m]["ratio"], 3) for m in FIELDS]
        for label in summary
    ]
    headers = ["tree", *(f"{m} us" for m in FIELDS), *(f"{m} ratio" for m in FIELDS)]
    return markdown_table(headers, rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, required=True, help="the first tree (src)")
    parser.add_argument("--after", type=Path, required=True, help="the second tree (src)")
    parser.add_argument("--pairs", type=int, default=4, help="alternating pairs (default 4)")
    parser.add_argument("--rounds", type=int, default=16, help="rounds per process")
    parser.add_argument("--pin", type=int, metavar="CPU", help="pin each process to this CPU")
    parser.add_argument("--steps", type=int, help="steps per block (default: fixed_cost.py's)")
    parser.add_argument("--label", default="")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    for tree in (args.before, args.after):
        if not (tree / "trainguard" / "__init__.py").is_file():
            parser.error(f"--before/--after: {tree} holds no trainguard package")
    trees = {"before": args.before, "after": args.after}
    runs: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
    report = {
        "benchmark": "fixed_cost_ab",
        "label": args.label,
        "date": now_iso(),
        "settings": {
            "pairs": args.pairs,
            "rounds": args.rounds,
            "steps_per_block": args.steps,
            "pinned_cpu": args.pin,
        },
        "trees": {label: str(tree) for label, tree in trees.items()},
        "machine": machine_info(),
        "runs": runs,
    }
    with tempfile.TemporaryDirectory(prefix="tg-ab-") as tmp:
        for pair in range(args.pairs):
            order = ("before", "after") if pair % 2 == 0 else ("after", "before")
            for label in order:
                runs[label].append(run_once(trees[label], args, Path(tmp) / f"{label}.json"))
                print(f"pair {pair} {label}: {runs[label][-1]['guard_check']}", file=sys.stderr)
                if all(runs.values()):  # written as it goes: a run cut short keeps its pairs
                    report["summary"] = summarize(runs)
                    write_json(args.out, report)
    print(table(report["summary"]))
    print(f"JSON: {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
