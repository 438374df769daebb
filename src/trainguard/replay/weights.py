"""Weights that were non-finite before the step: which kind, and what the bundle says of it.

- ``nonfinite_rows``: only some samples read the non-finite values (rows of an embedding or
  position table, per-class output rows, per-expert weights that only some inputs index): the
  samples are searched as for any cause, and the report names the non-finite rows, the op
  that read them, the samples that did, and whether the optimizer ever updated those rows
  (rows.py: a table grown by copying chunks whose tail was never initialised was never
  updated either).
- ``nonfinite_hyperparameter``: the update before the step wrote them, through a param group
  whose hyper-parameter was not finite (a learning-rate schedule that divided by zero):
  writer.py, from the history and the optimizer state.
- ``nonfinite_initial_weights``: no update of the run came before the step (the history
  runs from step 0 with none applied): the model's initialization or the weights the script
  loaded made them (a model built on the meta device whose parameters were not all
  initialized after ``to_empty()``: PyTorch's FSDP2 example on a CPU).
- ``nonfinite_weights``: any other; with what is known of the update that wrote them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from trainguard.replay.hops import Hop, Origin
from trainguard.replay.optimizer import OptimizerView
from trainguard.replay.rows import RowSet, RowUpdates, bad_rows, row_updates, spans
from trainguard.replay.sites import OpSite
from trainguard.replay.writer import Writer, find_writer, group_text, hypers_text, step_text


@dataclass
class WeightsEvidence:
    """What is known of the non-finite weights a step read."""

    names: list[str]
    """The non-finite parameters and buffers."""
    writer: Writer
    rows: RowSet | None = None
    """The non-finite rows of the tensor on the path to the step's bad value."""
    reader: OpSite | None = None
    """The first op that read that tensor on the path."""
    read_rows: list[int] | None = None
    """The non-finite rows that op read (an index op)."""
    readers: list[int] | None = None
    """The samples whose values the non-finite ones reached (None: not known)."""
    batch_size: int | None = None
    updates: RowUpdates | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def sample_specific(self) -> bool:
        """Only some samples read the non-finite values."""
        readers, size = self.readers, self.batch_size
        return bool(readers) and bool(size) and len(set(readers or [])) < (size or 0)

    @property
    def verdict(self) -> str:
        if self.writer.hypers and not self.sample_specific:
            return "nonfinite_hyperparameter"
        if self.sample_specific:
            return "nonfinite_rows"
        if self.writer.before_any_update:
            return "nonfinite_initial_weights"
        return "nonfinite_weights"

    def lead(self) -> str:
        """The summary's first sentence."""
        if self.verdict == "nonfinite_rows" and self.rows is not None and self.rows.partial:
            return f"Non-finite rows before the step: {self.rows.text()}."
        if self.verdict == "nonfinite_hyperparameter":
            return f"A non-finite hyper-parameter wrote the weights: {_hyper_where(self.writer)}."
        shown = ", ".join(self.names[:5]) + (
            f" and {len(self.names) - 5} more" if len(self.names) > 5 else ""
        )
        if self.verdict == "nonfinite_initial_weights":
            return f"Non-finite weights before the run's first update: {shown}."
        return f"Non-finite weights before the step: {shown}."

    def body(self, who: str) -> str | None:
        """The rest of the summary (``who``: the culprit samples' text); None: nothing known
        beyond the names."""
        if self.verdict == "nonfinite_rows":
            return self._rows_body(who)
        if self.verdict == "nonfinite_initial_weights":
            return (
                "No update of this run wrote them (the history runs from step 0 and none "
                "before this step was applied): they were non-finite when training began, "
                "made by the model's initialization or by the weights the script loaded (or "
                "by steps taken before the guard was)."
            )
        return _writer_body(self.writer, self.names)

    def _rows_body(self, who: str) -> str:
        site = self.reader
        where = ""
        if site is not None:
            module = site.module or "loss_fn, outside any module"
            where = f"{site.op} in {module} ({_file_line(site.source)}) "
        read = f"read rows {spans(self.read_rows)} of them" if self.read_rows else "read them"
        samples = _samples(self.readers or [])
        update = f"; {self.updates.text()}" if self.updates is not None else ""
        return f"{where}{read} for {samples} only (not every sample is to blame){update}; {who}."

    def to_dict(self) -> dict[str, Any]:
        return {
            "names": self.names,
            "rows": self.rows.to_dict() if self.rows else None,
            "read_by": self.reader.op if self.reader else None,
            "read_rows": self.read_rows,
            "readers": self.readers,
            "updates": self.updates.to_dict() if self.updates else None,
            "writer": self.writer.to_dict(),
        }


def _file_line(source: str | None) -> str:
    if not source:
        return "unknown line"
    path, _, line = source.rpartition(":")
    return f"{path.rsplit('/', 1)[-1]}:{line}"


def _samples(samples: Sequence[int]) -> str:
    noun = "sample" if len(samples) == 1 else "samples"
    return f"{noun} {spans(samples)}"


def _hyper_where(writer: Writer) -> str:
    group = writer.hypers[0].group
    if writer.from_history and writer.step is not None:
        values = hypers_text(writer.hypers, "was")
        return f"param group {group}'s {values} at step {writer.step} (history.json)"
    return f"param group {group}'s {hypers_text(writer.hypers, 'is')} in the optimizer state"


def _writer_body(writer: Writer, names: Sequence[str]) -> str | None:
    if writer.step is None and not writer.hypers:
        return None
    through = f" through {group_text(writer.group, writer.exact, names)}" if writer.group else ""
    if writer.step is None:
        return (
            f"An update wrote them{through}: {_hyper_where(writer)}. "
            f"{_moments_text(writer, bool(writer.hypers))}"
        )
    how = (
        "applied"
        if writer.decision == "ok"
        else f"applied by the loop (decision {writer.decision})"
    )
    applied = (
        f"Step {writer.step}'s loss and gradients were finite ({step_text(writer)}) and its "
        f"update was {how}: its forward read these weights finite"
        if writer.finite_before
        else f"Step {writer.step}'s update was {how} ({step_text(writer)})"
    )
    return (
        f"The update of step {writer.step} wrote them{through}. {applied}, "
        f"{_moments_text(writer, bool(writer.hypers))}"
    )


def _moments_text(writer: Writer, hyper: bool) -> str:
    names = ", ".join(writer.moment_names)
    if writer.moments == "finite":
        made = (
            "the hyper-parameter wrote them, not a gradient"
            if hyper
            else (
                "the update's own arithmetic made them (a hyper-parameter, or a division in the "
                "optimizer such as Adam's with eps=0), not a gradient"
            )
        )
        return f"and the optimizer's state of them ({names}) is finite: {made}."
    if writer.moments == "nonfinite":
        return (
            f"and the optimizer's state of them ({names}) is non-finite too: a non-finite "
            "gradient reached the optimizer (one the guard did not check: a step applied "
            "outside guard.check(), or gradients changed after it)."
        )
    if writer.moments == "none":
        return (
            "and the optimizer keeps no state of them that would tell a gradient from the update."
        )
    return "and the optimizer's state could not be matched to the parameters."


def weights_evidence(
    origins: Sequence[Origin],
    hop: Hop | None,
    readers: list[int] | None,
    batch_size: int | None,
    model: nn.Module,
    view: OptimizerView | None,
    history: list[dict[str, Any]] | None,
    step: int | None,
) -> WeightsEvidence:
    """The evidence about the non-finite weights ``origins`` (``parameter`` origins) that the
    step's bad value ``hop`` came from (``readers``: the samples it reached)."""
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    names = [o.label for o in origins if o.label]
    shapes = {n: tuple(tensors[n].shape) for n in names if n in tensors}
    found = WeightsEvidence(names, find_writer(names, shapes, step, history, view))
    chain = hop.chain() if hop is not None else []
    root = chain[0] if chain else None
    if root is None or root.origin.kind != "parameter" or root.origin.label not in tensors:
        return found
    name = root.origin.label or ""
    tensor = tensors[name]
    found.rows = bad_rows(name, tensor)
    found.readers, found.batch_size = readers, batch_size
    if len(chain) > 1:
        found.reader, found.read_rows = chain[1].site, chain[1].read_rows
    rows = found.read_rows or found.rows.indices
    state = view.state_of(name) if view is not None else None
    found.updates = row_updates(rows, list(tensor.shape), state) if found.rows.partial else None
    return found
