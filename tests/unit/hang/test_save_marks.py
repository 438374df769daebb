"""``torch.save`` on the loop's thread runs in a ``save`` phase while a guard marks it
(``hang/saves.py``); the 2-rank hang checks are in tests/distributed/test_rank_works_alone.py."""

from __future__ import annotations

import io
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import trainguard as tg
from trainguard.hang.progress import Progress
from trainguard.hang.saves import SAVE_PHASE, SaveMarks

ORIGINAL = torch.serialization.save


class PhaseSpy(io.BytesIO):
    """A file that notes the progress' phases while torch.save writes it."""

    def __init__(self, *progress: Progress) -> None:
        super().__init__()
        self.progress = progress
        self.seen: list[tuple[str, list[str]]] = []

    def write(self, data: Any) -> int:
        self.seen += [(p.phase, list(p.user_phases)) for p in self.progress]
        return super().write(data)


@pytest.fixture
def marks() -> Any:
    yield SaveMarks()
    assert torch.save is ORIGINAL and torch.serialization.save is ORIGINAL


def test_a_save_on_the_watching_thread_runs_in_the_save_phase(marks: SaveMarks) -> None:
    progress = Progress()
    progress.enter("data", 3)
    marking = marks.watch(progress)
    assert torch.save is not ORIGINAL and torch.serialization.save is torch.save
    spy = PhaseSpy(progress)
    torch.save({"x": torch.arange(3)}, spy)
    assert spy.seen and set(map(str, spy.seen)) == {str((SAVE_PHASE, [SAVE_PHASE]))}
    assert (progress.phase, progress.user_phases, progress.step) == ("data", [], 3)
    spy.seek(0)
    assert torch.equal(torch.load(spy)["x"], torch.arange(3))  # saved as without the mark
    marking.close()
    marking.close()  # idempotent


def test_the_phase_ends_when_the_save_fails(marks: SaveMarks) -> None:
    progress = Progress()
    progress.enter("step")
    marking = marks.watch(progress)
    with pytest.raises(AttributeError):
        torch.save({"x": 1}, object())  # no write(): torch.save raises
    assert (progress.phase, progress.user_phases) == ("step", [])
    marking.close()


def test_a_save_on_another_thread_marks_nothing(marks: SaveMarks) -> None:
    progress = Progress()
    progress.enter("step")
    marking = marks.watch(progress)
    spy = PhaseSpy(progress)
    thread = threading.Thread(target=torch.save, args=({"x": 1}, spy))
    thread.start()
    thread.join()
    assert spy.seen and {phase for phase, _ in spy.seen} == {"step"}
    marking.close()


def test_nested_in_a_user_phase_and_two_guards(marks: SaveMarks) -> None:
    first, second = Progress(), Progress()
    first.push_phase("checkpoint")
    marking_first, marking_second = marks.watch(first), marks.watch(second)
    spy = PhaseSpy(first, second)
    torch.save([1], spy)
    assert spy.seen[:2] == [(SAVE_PHASE, ["checkpoint", SAVE_PHASE]), (SAVE_PHASE, [SAVE_PHASE])]
    assert first.user_phases == ["checkpoint"] and second.user_phases == []
    marking_first.close()
    assert torch.save is not ORIGINAL  # the second still marks
    marking_second.close()


def test_a_wrapper_installed_later_is_left_alone(marks: SaveMarks) -> None:
    marking = marks.watch(Progress())
    theirs = torch.save

    def their_save(*args: Any, **kwargs: Any) -> None:
        theirs(*args, **kwargs)

    torch.save = their_save
    try:
        marking.close()
        assert torch.save is their_save  # not put back over theirs
        assert torch.serialization.save is ORIGINAL
    finally:
        torch.save = ORIGINAL


def test_a_single_process_guard_leaves_torch_save_alone(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with tg.Guard(model, optimizer, run_dir=tmp_path) as guard:
        assert guard._parts.watchdog is None and torch.save is ORIGINAL  # no watchdog, no phase


def test_mark_saves_must_be_a_bool(tmp_path: Path) -> None:
    with pytest.raises(tg.ConfigError, match="mark_saves"):
        tg.GuardConfig(run_dir=tmp_path, hang=tg.HangConfig(mark_saves="yes"))  # type: ignore[arg-type]


def test_someone_elses_wrapper_made_before_is_kept_inside(marks: SaveMarks) -> None:
    calls: list[int] = []

    def their_save(*args: Any, **kwargs: Any) -> None:
        calls.append(1)
        ORIGINAL(*args, **kwargs)

    torch.save = their_save
    try:
        progress = Progress()
        marking = marks.watch(progress)
        assert torch.serialization.save is ORIGINAL  # not the function scripts call: untouched
        spy = PhaseSpy(progress)
        torch.save([1], spy)
        assert calls == [1] and spy.seen[0][0] == SAVE_PHASE
        marking.close()
        assert torch.save is their_save
    finally:
        torch.save = ORIGINAL


def test_releasing_one_of_two_equal_progress_objects_keeps_the_other(marks: SaveMarks) -> None:
    first, second = Progress(), Progress()
    second.phase_since = first.phase_since  # equal as dataclasses, not the same object
    assert first == second
    marking_first, marking_second = marks.watch(first), marks.watch(second)
    marking_second.close()
    spy = PhaseSpy(first, second)
    torch.save([1], spy)
    assert spy.seen[:2] == [(SAVE_PHASE, [SAVE_PHASE]), ("init", [])]
    marking_first.close()
