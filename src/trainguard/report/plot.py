"""The run's timeline picture (matplotlib, from the ``plot`` extra, imported lazily).

Three panels sharing the step axis: the loss (mean over ranks) and the global gradient norm
on log scales, with markers for non-finite steps, skips, spikes, rollbacks, checkpoints and
hangs; and a rank x step strip with a cell wherever a rank saw a non-finite value and a bar
over the steps a rank was named a straggler.
"""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainguard.report.summary import RunSummary
from trainguard.report.timing import straggler_spans

if TYPE_CHECKING:
    from matplotlib.axes import Axes

MARKERS: dict[str, tuple[str, Any, str]] = {
    # kind: (colour, line style, label)
    "nonfinite": ("#d62728", "-", "non-finite"),
    "spike": ("#9467bd", ":", "spike"),
    "rollback": ("#1f77b4", "--", "rollback"),
    "checkpoint": ("#2ca02c", "-.", "checkpoint"),
    "hang": ("#000000", "-", "hang"),
    "straggler": ("#ff9f1c", "-", "straggler (strip)"),
}


def plot_available() -> bool:
    """Whether matplotlib (``pip install trainguard[plot]``) can be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def png_bytes(summary: RunSummary, width: float = 11.0) -> bytes:
    """The timeline as PNG bytes. Raises ImportError without matplotlib."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, 7.0), dpi=100, layout="constrained")
    loss_ax, norm_ax, strip_ax = fig.subplots(
        3, 1, sharex=True, gridspec_kw={"height_ratios": [3, 3, 1.6]}
    )
    points = summary.points
    steps = [p.step for p in points]
    _series(loss_ax, steps, [p.loss for p in points], "loss (mean over ranks)", "#333333")
    _series(norm_ax, steps, [p.grad_norm for p in points], "gradient norm (global)", "#ff7f0e")
    for ax in (loss_ax, norm_ax):
        _mark_events(ax, summary)
    _skips(loss_ax, summary)
    _strip(strip_ax, summary)
    fig.legend(handles=_legend_handles(), loc="outside upper right", fontsize=8, ncols=5)
    loss_ax.set_title(f"{summary.run_dir}: {summary.steps} steps", fontsize=10, loc="left")
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def write_png(summary: RunSummary, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(png_bytes(summary))
    return path


def _series(
    ax: Axes, steps: list[int], values: list[float | None], label: str, colour: str
) -> None:
    ys = [v if v is not None and math.isfinite(v) else math.nan for v in values]  # gaps
    finite = [y for y in ys if not math.isnan(y)]
    if finite:
        ax.plot(steps, ys, color=colour, linewidth=1.2, marker=".", markersize=3)
        if all(y > 0 for y in finite):
            ax.set_yscale("log")
        else:
            ax.set_yscale("symlog", linthresh=1e-3)
    bad = [s for s, v in zip(steps, values, strict=True) if v is not None and not _finite(v)]
    for step in bad:  # no place on a log axis: a marker on the top edge
        ax.plot(step, 1.0, marker="X", color=MARKERS["nonfinite"][0], transform=_top(ax))
    ax.set_ylabel(label, fontsize=9)
    ax.grid(True, which="major", alpha=0.3)


def _top(ax: Axes) -> Any:
    return ax.get_xaxis_transform()  # x in data, y in axes fraction


def _mark_events(ax: Axes, summary: RunSummary) -> None:
    groups = {
        "nonfinite": [e.get("step") for e in summary.nonfinite],
        "spike": [e.get("step") for e in summary.spikes],
        "rollback": [e.get("step") for e in summary.rollbacks],
        "checkpoint": [
            e.get("step") for e in summary.checkpoints if e.get("kind") in ("checkpoint", "resume")
        ],
        "hang": [h.get("step") for h in summary.hangs],
    }
    for kind, steps in groups.items():
        colour, style, _ = MARKERS[kind]
        for step in steps:
            if isinstance(step, int):
                ax.axvline(step, color=colour, linestyle=style, linewidth=1.2, alpha=0.8)


def _skips(ax: Axes, summary: RunSummary) -> None:
    skipped = [e.get("step") for e in summary.nonfinite if e.get("action") == "skip"]
    for step in skipped:
        if isinstance(step, int):
            ax.annotate("skip", (step, 0.02), xycoords=_top(ax), fontsize=7, ha="center")


def _strip(ax: Axes, summary: RunSummary) -> None:
    cells = summary.nonfinite_cells()
    world = summary.world_size or (max((r for r, _ in cells), default=0) + 1)
    if cells:
        ranks, steps = zip(*cells, strict=True)
        ax.scatter(steps, ranks, marker="s", s=40, color=MARKERS["nonfinite"][0])
    ax.set_ylim(-0.5, world - 0.5)
    ax.set_yticks(range(world) if world <= 16 else range(0, world, max(world // 8, 1)))
    ax.invert_yaxis()
    ax.set_ylabel("rank", fontsize=9)
    ax.set_xlabel("step", fontsize=9)
    _straggler_bars(ax, summary)
    title = (
        "where non-finite values appeared (rank x step; x: a hang's culprit rank; "
        "bars: a straggler)"
    )
    ax.set_title(title, fontsize=9, loc="left")
    ax.grid(True, axis="x", alpha=0.3)
    hung = [(r, h["step"]) for h in summary.hangs if isinstance(h.get("step"), int)
            for r in h.get("culprits") or []]  # fmt: skip
    if hung:
        ranks, steps = zip(*hung, strict=True)
        ax.scatter(steps, ranks, marker="x", s=60, color=MARKERS["hang"][0], label="hang culprit")
    last = max([summary.steps - 1, *(s for _, s in hung)], default=0)
    ax.set_xlim(-0.5, last + 0.5)


def _straggler_bars(ax: Axes, summary: RunSummary) -> None:
    colour = MARKERS["straggler"][0]
    for rank, start, stop, phase in straggler_spans(summary.stragglers, summary.steps):
        ax.hlines(rank, start - 0.5, stop - 0.5, colors=colour, linewidth=6, alpha=0.7)
        ax.annotate(phase, (start, rank), xytext=(2, 4), textcoords="offset points", fontsize=7)


def _legend_handles() -> list[Any]:
    from matplotlib.lines import Line2D

    return [
        Line2D([], [], color=colour, linestyle=style, label=label)
        for colour, style, label in MARKERS.values()
    ]


def _finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)
