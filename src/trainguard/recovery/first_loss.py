"""The first loss after a rollback or a resume, compared with the one saved with the state.

A snapshot and a known-good checkpoint keep the loss of their step's first batch. The first
loss after restoring one is compared with it; beyond ``loss_tolerance`` (relative) a
``loss_mismatch`` event says the weights or the data are not what was saved. After a resume
the comparison is armed only when ``watch()`` feeds the resumed step the checkpoint's own
first batch (the skip ledger did not drop it; without ``watch()`` the batch is unknown);
after a rollback the batch differs by construction (the failing ones are skipped), so a
mismatch there is information.
"""

from __future__ import annotations

from trainguard.events import EventLog


class FirstLossCheck:
    """``resumed`` / ``rolled_back`` arm it, ``stream_started`` confirms a resume's batch,
    ``good_step`` compares."""

    def __init__(self, events: EventLog, tolerance: float) -> None:
        self._events = events
        self._tolerance = tolerance
        self._expected: tuple[int, float, str] | None = None
        self._resumed: tuple[int, float] | None = None
        """The resumed checkpoint's step and first loss, until its pass starts."""

    def resumed(self, step: int, loss: float | None) -> None:
        self._resumed = (step, loss) if loss is not None else None

    def stream_started(self, same_batch: bool) -> None:
        """The resumed pass starts: compare only when its first batch is the checkpoint's."""
        resumed, self._resumed = self._resumed, None
        if resumed is not None and same_batch:
            self._expected = (resumed[0], resumed[1], "resume")

    def rolled_back(self, step: int, loss: float | None) -> None:
        if loss is not None:
            self._expected = (step, loss, "rollback")

    def good_step(self, step: int, loss: float) -> None:
        expected = self._expected
        if expected is None or step != expected[0]:
            return
        self._expected = None
        saved, why = expected[1], expected[2]
        if abs(loss - saved) > self._tolerance * max(abs(saved), 1e-12):
            self._events.write("loss_mismatch", step, after=why, loss=loss, saved_loss=saved)
