"""Which collective the main thread waits in, read from its Python stack
(``sys._current_frames()``, from the watchdog thread), and the user's line that called it.

* **A torch.distributed call** (``dist.barrier()``, ``all_reduce``, ``broadcast``...): the
  outermost frame of ``torch/distributed`` named after a collective, in the innermost run of
  torch and trainguard frames (``all_gather_object`` rather than the ``all_gather`` it calls).
* **The guard's own all-reduce** (``guard.check`` / ``guard.step``): a frame of
  ``trainguard/step/consensus.py`` in that run.
* **Backward** (``loss.backward()``: ``torch/autograd`` frames, no collective frame): in a
  process with a ``DistributedDataParallel`` model that is DDP's gradient all-reduce (its
  reducer waits for the buckets at the end of backward, in C++), else plain ``backward``.
* **The call site**: the innermost frame outside torch, trainguard and the standard library
  (else outside torch and trainguard).

A collective started with ``async_op=True`` and waited for later, or an NCCL collective
(asynchronous on the GPU), is not visible here: the flight recorder sees those.
"""

from __future__ import annotations

import gc
import os
import sys
import sysconfig
import threading
from collections.abc import Callable
from dataclasses import dataclass
from importlib.util import find_spec
from types import FrameType, TracebackType

COLLECTIVES = frozenset(
    {
        "barrier",
        "monitored_barrier",
        "all_reduce",
        "all_reduce_coalesced",
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_object",
        "all_gather_coalesced",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "broadcast",
        "broadcast_object_list",
        "reduce",
        "gather",
        "gather_object",
        "scatter",
        "scatter_object_list",
        "all_to_all",
        "all_to_all_single",
        "send",
        "recv",
        "send_object_list",
        "recv_object_list",
        "batch_isend_irecv",
        "_all_gather_base",
        "_reduce_scatter_base",
    }
)
"""torch.distributed functions that are (or wrap) a collective or point-to-point call."""

DDP_ALL_REDUCE = "DDP's gradient all_reduce"
DDP_BROADCAST = "DDP's buffer broadcast"
GUARD_ALL_REDUCE = "trainguard's check all_reduce"

_SEP = os.sep


def _package_dir(name: str) -> str:
    """The folder of the installed package ``name``, found without importing it (a folder no
    file is in when it is not installed: no frame is taken for its)."""
    spec = find_spec(name)
    origin = spec.origin if spec is not None else None
    return os.path.dirname(origin) + _SEP if origin else f"{_SEP}\0{name}-not-installed{_SEP}"


TORCH_DIR = _package_dir("torch")
"""torch's folder (found without importing torch: ``trainguard report`` reads stacks)."""
TRAINGUARD_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + _SEP
_STDLIB = tuple(
    {sysconfig.get_paths()[key] + _SEP for key in ("stdlib", "platstdlib")}
    | {os.path.dirname(os.__file__) + _SEP}
)


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    function: str


@dataclass(frozen=True)
class StackCall:
    """What the stack says: ``op`` (None: no collective), how to say it, and the call site."""

    op: str | None
    label: str
    site: Frame | None


def main_thread_frames() -> list[Frame]:
    """The main thread's stack, outermost first (empty when it has none)."""
    ident = threading.main_thread().ident
    frame = sys._current_frames().get(ident) if ident is not None else None
    return frames_of(frame)


def frames_of(frame: FrameType | None) -> list[Frame]:
    out: list[Frame] = []
    while frame is not None:
        code = frame.f_code
        out.append(Frame(code.co_filename, frame.f_lineno or 0, code.co_name))
        frame = frame.f_back
    out.reverse()
    return out


def frames_of_traceback(tb: TracebackType | None) -> list[Frame]:
    """An exception's traceback as frames, outermost first (where it was raised last)."""
    out: list[Frame] = []
    while tb is not None:
        code = tb.tb_frame.f_code
        out.append(Frame(code.co_filename, tb.tb_lineno or 0, code.co_name))
        tb = tb.tb_next
    return out


def in_torch(frame: Frame) -> bool:
    return frame.file.startswith(TORCH_DIR)


def in_library(frame: Frame) -> bool:
    """torch's or trainguard's own code."""
    return frame.file.startswith((TORCH_DIR, TRAINGUARD_DIR))


def in_user_code(frame: Frame) -> bool:
    if in_library(frame) or frame.file.startswith(_STDLIB):
        return False
    return not frame.file.startswith("<")


def classify(frames: list[Frame], ddp_present: Callable[[], bool]) -> StackCall:
    """The collective the innermost run of torch/trainguard frames is in (module docstring)."""
    run = innermost_library_run(frames)
    site = user_site(frames)
    calls = [call for call in map(_collective_of, run) if call is not None]
    if calls:
        op, label = calls[0]
        return StackCall(op, label, site)
    if any(f.file.endswith(f"step{_SEP}consensus.py") and not in_torch(f) for f in run):
        return StackCall("all_reduce", GUARD_ALL_REDUCE, site)
    if any(_is_backward(f) for f in run):
        if ddp_present():
            return StackCall("all_reduce", DDP_ALL_REDUCE, site)
        return StackCall(None, "backward", site)
    return StackCall(None, "", site)


def innermost_library_run(frames: list[Frame]) -> list[Frame]:
    """The innermost frames of torch or trainguard, outermost first, up to the user frame
    that called them; empty when the innermost frame (below standard-library ones, e.g.
    ``threading``'s ``wait``) is user code."""
    end = len(frames)
    while end > 0 and not in_library(frames[end - 1]) and not in_user_code(frames[end - 1]):
        end -= 1
    start = end
    while start > 0 and not in_user_code(frames[start - 1]):
        start -= 1
    return frames[start:]


def user_site(frames: list[Frame]) -> Frame | None:
    """The innermost frame outside torch, trainguard and the standard library (else outside
    torch and trainguard)."""
    for frame in reversed(frames):
        if in_user_code(frame):
            return frame
    for frame in reversed(frames):
        if not in_library(frame):
            return frame
    return None


def ddp_in_process() -> bool:
    """Whether a ``DistributedDataParallel`` module exists in this process: first among the
    values the main thread's frames hold (its locals and globals: microseconds), else one
    pass over the objects the garbage collector tracks (about 0.1 s for 300,000 objects;
    only at a stall, and the probe keeps a True)."""
    module = sys.modules.get("torch.nn.parallel.distributed")
    ddp = getattr(module, "DistributedDataParallel", None)
    if not isinstance(ddp, type):
        return False
    is_ddp = _type_check(ddp)
    ident = threading.main_thread().ident
    frame = sys._current_frames().get(ident) if ident is not None else None
    while frame is not None:
        if any(is_ddp(value) for value in _frame_values(frame)):
            return True
        frame = frame.f_back
    return any(is_ddp(obj) for obj in gc.get_objects())


def _frame_values(frame: FrameType) -> list[object]:
    try:
        return [*frame.f_locals.values(), *frame.f_globals.values()]
    except Exception:  # a frame's locals can fail to materialize: then skip it
        return []


def _type_check(cls: type) -> Callable[[object], bool]:
    """``isinstance(obj, cls)`` by the type's MRO, cached per type: ``isinstance`` itself
    goes through ``ABCMeta`` for DDP (a ``Joinable``), asks ``obj.__class__`` (which raises
    for a dead ``weakref.proxy``) and costs microseconds per object."""
    seen: dict[type, bool] = {}

    def check(obj: object) -> bool:
        kind = type(obj)
        hit = seen.get(kind)
        if hit is None:
            hit = seen[kind] = cls in kind.__mro__
        return hit

    return check


def _collective_of(frame: Frame) -> tuple[str, str] | None:
    """(op, label) of a frame that is a collective call, else None."""
    if frame.file == f"{TORCH_DIR}nn{_SEP}parallel{_SEP}distributed.py":
        if frame.function == "_distributed_broadcast_coalesced":
            return "broadcast", DDP_BROADCAST
        return None
    if frame.file.startswith(f"{TORCH_DIR}distributed{_SEP}") and frame.function in COLLECTIVES:
        return frame.function, frame.function
    return None


def _is_backward(frame: Frame) -> bool:
    autograd = frame.file.startswith(f"{TORCH_DIR}autograd{_SEP}")
    tensor = frame.file == f"{TORCH_DIR}_tensor.py" and frame.function == "backward"
    return tensor or (autograd and frame.function in ("backward", "_engine_run_backward", "grad"))
