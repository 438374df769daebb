"""``fixed_cost.py``'s breakdown: where the guard's microseconds go.

The loop's phases (next batch, forward + backward, check, update) timed around each call in a
bare loop, a control (the bare loop plus about 100 us of unrelated Python where the guard
checks) and a guarded loop, interleaved; and inside the guard per-part timers: named methods
of the guard's parts wrapped in a timer (inclusive times; the timer's own cost is measured
and subtracted). ``PARTS`` names them; keep it pointed at the guard's structure.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _common import markdown_table, median
from _fixed_cost_loops import Loop

import trainguard as tg

_MEASURE = "trainguard.step.measure:StepMeasure"
_LONE = "trainguard.step.lone:LoneStep"
PARTS: tuple[tuple[str, str, str], ...] = (
    # (label, owner: "guard.<attr path>", a module or "module:Class", attribute)
    ("check()", "guard", "check"),
    ("  _lone.take: the usual step (world of one)", "guard._lone", "take"),
    ("    InputCheck.foldable", "guard._inputs", "foldable"),
    ("    the fused pass and the read (_read)", _LONE, "_read"),
    ("    record and apply (_commit)", _LONE, "_commit"),
    ("      history.add (ring + metrics)", "guard.history", "add"),
    ("        MetricsLog.add (incl. its flushes)", "guard.history._metrics", "add"),
    ("      spikes.judge_values", "guard.spikes", "judge_values"),
    ("  torch._foreach_norm (every caller)", "torch", "_foreach_norm"),
    ("  torch.stack (every caller)", "torch", "stack"),
    ("  _check: the full path (other steps)", "guard", "_check"),
    ("    _measure: buffers, gradient pass, row", "guard", "_measure"),
    ("      grad_stats (fused norm pass)", "trainguard.step.measure", "grad_stats"),
    ("      losses and inputs for the folded row", _MEASURE, "_fold_pieces"),
    ("      the folded row (world of one)", _MEASURE, "_folded"),
    ("      the reduced row (other ranks)", _MEASURE, "_report"),
    ("    consensus.agree (row, all-reduce, read)", "guard._consensus", "agree"),
    ("    history.record", "guard.history", "record"),
    ("    decision.apply (state, spikes)", "guard._decision", "apply"),
    ("step start hook (StepStart.begin)", "guard._start", "begin"),
    ("  RNG snapshot (RngSnapshot.take)", "trainguard.capture.rng:RngSnapshot", "take"),
    ("  autocast probe (_autocast_now)", "guard._start", "_autocast_now"),
    ("  buffers.begin", "guard._start.buffers", "begin"),
)
"""Owners: ``guard.<attr path>``, a module, or ``module:Class`` (a class attribute)."""


class Timers:
    def __init__(self) -> None:
        self.total: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def wrap(self, label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        total, calls, clock = self.total, self.calls, time.perf_counter
        total.setdefault(label, 0.0)
        calls.setdefault(label, 0)

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                total[label] += clock() - start
                calls[label] += 1

        return timed


def _owner(guard: tg.Guard, path: str) -> Any:
    if not path.startswith("guard"):
        module, _, name = path.partition(":")
        found = importlib.import_module(module)
        return getattr(found, name, None) if name else found
    obj: Any = guard
    for attr in path.split(".")[1:]:
        obj = getattr(obj, attr, None)
        if obj is None:
            return None
    return obj


def _instrument(guard: tg.Guard, timers: Timers) -> tuple[list[str], Callable[[], None]]:
    """Wrap the parts; returns the labels found and an undo."""
    found, undo = [], []
    for label, path, attr in PARTS:
        owner = _owner(guard, path)
        if owner is None or not hasattr(owner, attr):
            continue
        original = getattr(owner, attr)
        raw = vars(owner).get(attr) if isinstance(owner, type) else None
        setattr(owner, attr, timers.wrap(label, original))
        found.append(label)
        if isinstance(owner, type):  # a class: put its own attribute (a descriptor) back
            undo.append(functools.partial(setattr, owner, attr, raw))
        elif isinstance(owner, type(sys)):
            undo.append(functools.partial(setattr, owner, attr, original))
        else:  # an instance attribute shadowing the class's method
            undo.append(functools.partial(_delattr, owner, attr))

    def undo_all() -> None:
        for step in reversed(undo):
            step()

    return found, undo_all


def _delattr(obj: Any, attr: str) -> None:
    with contextlib.suppress(AttributeError):
        delattr(obj, attr)


def _timer_cost() -> float:
    """Seconds a wrapped no-op call costs beyond the call itself."""
    timers = Timers()
    noop = timers.wrap("noop", lambda: None)
    n = 20000
    start = time.perf_counter()
    for _ in range(n):
        noop()
    wrapped = (time.perf_counter() - start) / n
    plain: Callable[[], None] = lambda: None  # noqa: E731
    start = time.perf_counter()
    for _ in range(n):
        plain()
    return max(0.0, wrapped - (time.perf_counter() - start) / n)


def unrelated_python() -> int:
    """The control's work between backward and update: about 100 us of Python that touches
    fresh objects (a dict of lists, its JSON text), unrelated to the training step."""
    table = {f"k{i}": (i, float(i), str(i)) for i in range(60)}
    return len(json.dumps(table)) + sum(len(text) for _, _, text in table.values())


def phases(
    loops: dict[str, tuple[Loop, Callable[[], object] | None]], steps: int, rounds: int
) -> dict[str, dict[str, float]]:
    """Per loop, the median over ``rounds`` of the microseconds per step in each phase of the
    loop; the loops interleaved, in a freshly shuffled order each round. A loop's ``between``
    (the guard's ``check()``, or the control's unrelated Python) runs where the guard would
    check: whether the user's own phases slow down after it tells the guard's own cost from
    what any Python between two steps does to the forward and the update."""
    names = ("next batch", "forward+backward", "check", "update")
    found: dict[str, dict[str, list[float]]] = {n: {k: [] for k in names} for n in loops}
    order, rng, clock = list(loops), random.Random(0), time.perf_counter
    for _ in range(rounds):
        rng.shuffle(order)
        for name in order:
            loop, between = loops[name]
            acc = dict.fromkeys(names, 0.0)
            batches, guard = loop.batches, loop.guard
            for _ in range(steps):
                t0 = clock()
                batch = next(batches)
                t1 = clock()
                loss = loop._loss(batch)
                t2 = clock()
                ok = guard.check(loss) if guard is not None else True
                if between is not None:
                    between()
                t3 = clock()
                if ok:
                    loop.opt.step()
                loop.opt.zero_grad(set_to_none=True)
                t4 = clock()
                acc["next batch"] += t1 - t0
                acc["forward+backward"] += t2 - t1
                acc["check"] += t3 - t2
                acc["update"] += t4 - t3
            for key, value in acc.items():
                found[name][key].append(1e6 * value / steps)
    return {n: {k: median(v) for k, v in per.items()} for n, per in found.items()}


def breakdown(seed: int, steps: int, rounds: int, run_dir: Path) -> dict[str, Any]:
    bare, guarded = Loop("bare", seed, run_dir), Loop("guard_check", seed, run_dir / "bd")
    control = Loop("bare", seed, run_dir)
    for loop in (bare, guarded, control):
        loop.run(steps)
    loop_phases = phases(
        {
            "bare": (bare, None),
            "bare+python": (control, unrelated_python),
            "guard_check": (guarded, None),
        },
        steps,
        rounds,
    )
    assert guarded.guard is not None
    timers = Timers()
    labels, undo = _instrument(guarded.guard, timers)
    overhead = _timer_cost()
    guarded.run(steps)  # warm the wrappers
    for label in labels:
        timers.total[label], timers.calls[label] = 0.0, 0
    per_round: dict[str, list[float]] = {label: [] for label in labels}
    for _ in range(rounds):
        before = dict(timers.total)
        guarded.run(steps)
        for label in labels:
            per_round[label].append(1e6 * (timers.total[label] - before[label]) / steps)
    calls = {label: timers.calls[label] / (rounds * steps) for label in labels}
    undo()
    guarded.close()
    parts = {
        label: {
            "us_per_step": max(0.0, median(per_round[label]) - 1e6 * overhead * calls[label]),
            "calls_per_step": calls[label],
        }
        for label in labels
    }
    return {
        "loop_phases_us": loop_phases,
        "parts": parts,
        "timer_overhead_us_per_call": 1e6 * overhead,
        "steps": steps,
        "rounds": rounds,
    }


def breakdown_table(found: dict[str, Any]) -> str:
    phase_rows = []
    loops = found["loop_phases_us"]
    bare, control, guard = loops["bare"], loops["bare+python"], loops["guard_check"]
    for phase in bare:
        phase_rows.append(
            [
                phase,
                round(bare[phase], 1),
                round(control[phase], 1),
                round(guard[phase], 1),
                round(guard[phase] - bare[phase], 1),
            ]
        )
    headers = ["loop phase", "bare us", "bare + unrelated Python us", "guarded us", "guard adds us"]
    text = markdown_table(headers, phase_rows)
    part_rows = [
        [f"`{label}`", round(entry["us_per_step"], 1), round(entry["calls_per_step"], 2)]
        for label, entry in found["parts"].items()
    ]
    text += "\n\n" + markdown_table(["guard part (inclusive)", "us/step", "calls/step"], part_rows)
    return text
