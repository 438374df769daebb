"""TensorBoard: ``guard.metrics()`` as scalars, the guard's notable events as text.

    from trainguard.integrations.tensorboard import TensorBoardLogger

    guard = tg.Guard(model, opt, run_dir="runs/x")
    tb = TensorBoardLogger(guard)
    with guard:
        for step, batch in enumerate(guard.watch(loader)):
            ...
            if guard.check(loss):
                opt.step()
            tb.log(step)            # trainguard/skipped_steps, trainguard/loss, ... as scalars
    tb.close()                      # after the guard's close (its last events come there)

Needs ``tensorboard`` (extra ``trainguard[tensorboard]``); the writer is
``torch.utils.tensorboard.SummaryWriter`` (pass your own to share its event file), written to
``run_dir/tensorboard/<run id>`` by default (``default_log_dir``: one TensorBoard run per
trainguard run), on rank 0 only (the numbers are the same on every rank).

Scalars: ``log(step)`` writes ``guard.metrics()`` (host numbers the guard already holds: no
sync, no collective); call it as often as you log the rest. Events: the logger listens on the
guard's event log (``EventLog.add_listener``) and writes each notable event (``NOTABLE``:
skip, non-finite, spike, rollback, rerun, straggler, replica divergence, hang...) at once as
text under the tag ``trainguard/events`` and flushes: no file is read,
and nothing is done on a step without such an event. ``hang`` and ``peer_failure`` events
are written by the hang watchdog's thread just before the process exits; the flush makes
them reach the file first. An event is placed where the scalars of its step are: at the
guard's step plus the offset between your counter and the guard's at the last ``log(step)``,
or, when ``log()`` is given no step, plus the steps the rollbacks so far made the run take
again: the x axis only goes forward (a rollback sends the guard's step back; the text still
says the guard's step).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol

from trainguard.events import to_jsonable
from trainguard.step.guard import Guard

logger = logging.getLogger(__name__)

NOTABLE = frozenset(
    {
        "nonfinite",
        "bad_input",
        "skip",
        "capture",
        "spike",
        "escalate",
        "rollback",
        "rollback_refused",
        "rerun",
        "suspect_host",
        "straggler",
        "replica_divergence",
        "buffers_not_restored",
        "hang",
        "peer_failure",
    }
)
"""The event kinds written as text by default."""

TEXT_TAG = "trainguard/events"
"""The text's tag (``SummaryWriter.add_text`` stores it as ``trainguard/events/text_summary``)."""
MAX_TEXT = 800
"""Characters of an event's fields shown (a ``nonfinite`` event can name many parameters)."""


class Writer(Protocol):
    """What is used of ``torch.utils.tensorboard.SummaryWriter``."""

    def add_scalar(self, tag: str, scalar_value: Any, global_step: int | None = None) -> Any: ...
    def add_text(self, tag: str, text_string: str, global_step: int | None = None) -> Any: ...
    def flush(self) -> Any: ...
    def close(self) -> Any: ...


def summary_writer(log_dir: Path | str) -> Writer:
    """A ``torch.utils.tensorboard.SummaryWriter`` (ImportError naming the extra without
    ``tensorboard``)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:  # torch's module imports tensorboard
        raise ImportError(
            "trainguard.integrations.tensorboard needs tensorboard: "
            "pip install 'trainguard[tensorboard]'"
        ) from exc
    writer: Writer = SummaryWriter(log_dir=str(log_dir))
    return writer


def default_log_dir(guard: Guard) -> Path:
    """``run_dir/tensorboard/<run id>``: one TensorBoard run per trainguard run. A torchrun
    restart or a ``resume`` of the run goes on in its directory; another run in the same
    ``run_dir`` gets its own, so two runs' steps never land in one TensorBoard run."""
    base = Path(guard.run_dir) / "tensorboard"
    run = guard.events.run
    return base / run.id if run is not None else base


def write_scalars(writer: Writer, metrics: dict[str, float | int], step: int) -> None:
    """``guard.metrics()`` (or any flat dict of numbers) as scalars at ``step``."""
    for key, value in metrics.items():
        writer.add_scalar(key, value, global_step=step)


def event_text(record: dict[str, Any]) -> str:
    """One event as a line of TensorBoard text (markdown)."""
    fields = {k: v for k, v in record.items() if k not in ("time", "rank", "step", "kind", "run")}
    shown = json.dumps(to_jsonable(fields), separators=(", ", ": "))
    if len(shown) > MAX_TEXT:
        shown = shown[:MAX_TEXT] + " ..."
    return f"**{record['kind']}** at step {record['step']} (rank {record['rank']}): `{shown}`"


class TensorBoardLogger:
    """Writes ``guard.metrics()`` as scalars (``log``) and the guard's notable events as text.

    ``writer``: a ``SummaryWriter`` to share (it stays open at ``close``); default: one of its
    own in ``log_dir`` (default ``default_log_dir``: ``run_dir/tensorboard/<run id>``).
    ``events``: the kinds written as text. ``all_ranks``: every rank writes (give each its
    own ``log_dir``); default rank 0.
    """

    def __init__(
        self,
        guard: Guard,
        writer: Writer | None = None,
        *,
        log_dir: Path | str | None = None,
        events: frozenset[str] = NOTABLE,
        all_ranks: bool = False,
    ) -> None:
        self.guard = guard
        self.events = frozenset(events)
        self._owned = False
        self.writer: Writer | None = None
        self._offset = 0
        """Your step minus the guard's, at the last ``log(step)``: where events go."""
        self._logged: int | None = None
        """The guard's step whose metrics ``log`` wrote last (None: ``log`` never called)."""
        self._own_steps = False
        """``log(step)`` was given the loop's counter (then ``_offset`` places everything)."""
        self._taken_again = 0
        """Steps the run took again after its rollbacks so far (``log()`` without a step:
        the guard's step plus this is the x axis, which only goes forward)."""
        self._pending: tuple[int, object] | None = None
        """A rollback not yet passed: the steps it makes the run take again, and the record
        of the step that escalated (the steps decided after it count them)."""
        if all_ranks or guard.rank == 0:
            if writer is None:
                writer = summary_writer(log_dir or default_log_dir(guard))
                self._owned = True
            self.writer = writer
            guard.events.add_listener(self._on_event)

    def log(self, step: int | None = None) -> None:
        """``guard.metrics()`` as scalars at ``step`` (default: the step the numbers are of,
        the last decided one: ``trainguard/step - 1`` but after a rollback, which sends the
        guard's step back, and under the sync-free ``step()``, read a step late). Pass your
        loop's own counter to line them up with your other scalars (after a rollback the
        guard's steps repeat)."""
        writer = self.writer
        if writer is None:
            return
        metrics = self.guard.metrics()
        decided = self._decided(metrics)
        if step is not None:
            self._own_steps = True
            self._offset = step - decided
        else:
            self._pass_rollback()
            self._offset = self._taken_again
        self._logged = decided
        write_scalars(writer, metrics, decided + self._offset)

    def _pass_rollback(self) -> None:
        """A rollback seen and a step decided after it: from now on, x counts its steps."""
        pending = self._pending
        if pending is not None and self.guard.history.last() is not pending[1]:
            self._taken_again += pending[0]
            self._pending = None

    def _decided(self, metrics: dict[str, float | int]) -> int:
        """The guard's step that ``metrics`` describe: the newest record of its history."""
        last = self.guard.history.last()
        return last.step if last is not None else int(metrics["trainguard/step"]) - 1

    def _on_event(self, record: dict[str, Any]) -> None:
        writer = self.writer
        if writer is None:
            return
        kind = record.get("kind")
        if kind == "close":
            self._log_unlogged(writer)
        step = record.get("step")
        after = self._pending is not None and not self._own_steps  # past a rollback
        offset = self._offset + (self._pending[0] if after and self._pending else 0)
        if kind == "rollback":
            self._rolled_back(record)
        if kind not in self.events:
            return
        at = step + offset if isinstance(step, int) else 0
        writer.add_text(TEXT_TAG, event_text(record), global_step=at)
        writer.flush()  # rare; and a hang's event must be on disk before the exit

    def _rolled_back(self, record: dict[str, Any]) -> None:
        """The steps from the restored one to the escalating one are taken again."""
        step, restored = record.get("step"), record.get("restored_step")
        if isinstance(step, int) and isinstance(restored, int) and not self._own_steps:
            self._pass_rollback()
            self._pending = (step + 1 - restored, self.guard.history.last())

    def _log_unlogged(self, writer: Writer) -> None:
        """At the guard's close: the numbers of a step decided after the last ``log`` (the
        sync-free ``step()`` reads its last step in ``close()``), at that step."""
        if self._logged is None:
            return  # the loop logs no scalars through this logger
        metrics = self.guard.metrics()
        decided = self._decided(metrics)
        if decided != self._logged:
            self._logged = decided
            write_scalars(writer, metrics, decided + self._offset)

    def close(self) -> None:
        """Stop listening; flush (and close the writer this logger made)."""
        writer, self.writer = self.writer, None
        if writer is None:
            return
        self.guard.events.remove_listener(self._on_event)
        if self._owned:
            writer.close()
        else:
            writer.flush()

    def __enter__(self) -> TensorBoardLogger:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
