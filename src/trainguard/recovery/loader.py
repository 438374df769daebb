"""A data loader's own state (torchdata's ``StatefulDataLoader``), duck-typed.

A loader with ``state_dict()`` and ``load_state_dict()`` is resumed through its own state
instead of by skipping the consumed batches: the checkpoint stores the state that describes
exactly the batches consumed by the steps before it, and a resumed ``watch()`` loads it before
iterating. torchdata is never imported here.

The stream fetches ahead of the step boundary (a step's batches, plus the lookahead), so the
loader's ``state_dict()`` at the boundary would describe batches not yet trained on. The state
is therefore taken before each item is fetched, kept by position (items of the epoch taken so
far), and the one at the boundary's position is what a checkpoint saves. Only the few states
between the boundary and the prefetch front are held; each is a deep copy (the loader may
update nested parts of its state in place).
"""

from __future__ import annotations

import copy
from typing import Any


def is_stateful(iterable: Any) -> bool:
    """Whether ``iterable`` has a state of its own to save and load (a StatefulDataLoader)."""
    return callable(getattr(iterable, "state_dict", None)) and callable(
        getattr(iterable, "load_state_dict", None)
    )


class LoaderStates:
    """States of a stateful loader, taken before each item is fetched, keyed by position."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader
        self._states: dict[int, Any] = {}

    def before_fetch(self, position: int) -> None:
        """The stream's ``on_fetch``: the state with ``position`` items of the epoch taken."""
        self._states[position] = copy.deepcopy(self._loader.state_dict())

    def at(self, position: int) -> Any | None:
        """The state with ``position`` items consumed (None: not recorded); forgets the older."""
        self.forget_before(position)
        return self._states.get(position)

    def forget_before(self, position: int) -> None:
        for old in [p for p in self._states if p < position]:
            del self._states[old]

    def __len__(self) -> int:
        return len(self._states)
