"""The guard's collectives are released on the main thread, never on gloo's worker thread.

Why (issue 15: ``terminate called without an active exception`` and SIGABRT at the exit of a
finished gloo job). ``dist.all_reduce(buf)`` hands ``buf`` (a tensor created in Python, so
it has a Python object) to ``ProcessGroupGloo``. Gloo's worker thread (``pt_gloo_runloop``)
runs the work, marks it complete (``wait()`` returns on the main thread) and only then drops
its own reference to the work. When that is the last reference, the work's destructor
releases the tensor, and for a tensor with a Python object torch must take the GIL for it
(``TensorImpl::decref_pyobject``, a ``noexcept`` function). If the main thread has meanwhile
gone on to interpreter shutdown (the guard's all-reduce is the last collective of a guarded
loop), Python 3.11 ends a thread that asks for the GIL after finalization has begun with
``pthread_exit``; the forced unwind meets the ``noexcept`` frame and the C++ runtime calls
``std::terminate``. Whether it happens depends on whether gloo's thread gets the GIL before
the main thread starts finalizing: a few runs in a hundred on a busy machine. DDP's own
all-reduces use C++-only bucket tensors (no Python object, no GIL), which is why the same
loop without the guard never aborts.

The fix: keep the ``Work`` of the guard's latest collective (``HeldWork``), so the reference
gloo's thread drops is never the last one and its release needs no GIL; the work (and the
tensor) is released by the main thread when the next collective replaces it, and the last one
is kept until interpreter exit (``retire``), long after gloo's thread let go of it.
"""

from __future__ import annotations

from typing import Any

_RETIRED: list[Any] = []
"""Works of closed guards, kept until the process ends (one per guard): released by the main
thread during interpreter shutdown, never by gloo's worker thread."""


class HeldWork:
    """Holds the ``Work`` of the latest collective of one owner (e.g. ``Consensus``)."""

    def __init__(self) -> None:
        self._work: Any = None

    @property
    def held(self) -> bool:
        return self._work is not None

    def wait(self, work: Any) -> None:
        """``work.wait()`` (as a synchronous collective does), then keep ``work``. The work
        it replaces is released here, on the calling thread (gloo's thread let go of it when
        it completed, a step ago)."""
        if work is None:
            return
        work.wait()
        self._work = work

    def retire(self) -> None:
        """The owner is closing: keep its last work until the process ends."""
        if self._work is not None:
            _RETIRED.append(self._work)
            self._work = None


def retired_count() -> int:
    """Works kept until exit (tests)."""
    return len(_RETIRED)
