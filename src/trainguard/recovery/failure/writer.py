"""A rank's state at the start of the step in flight, written at a failure: once, atomically,
within a bounded time.

Triggers (each calls ``save``; the first writes, the others wait for it): the launcher's
SIGTERM (``on_terminate.py``), the watchdog's exit on a peer failure or a hang (before exit
code 91/92), an exception that ends the ``with Guard`` block. The state is copied while the
step's boundary is open, and kept only if the step did not move meanwhile (``boundary.py``),
then written by a thread of its own to ``state-<step>-rank-<r>.pt.tmp``, renamed,
and described last by its JSON (size, SHA-256, the weights' digest): a write that is not done
within ``recovery.failure_save_seconds`` is dropped with its temporary file, and a state that
would not fit in the folder's file system is refused. Each outcome is a ``failure_state``
event (``saved`` true or false, and why).

CUDA tensors are copied on a stream of their own: the main thread may be blocked inside a
collective whose kernel never ends, which a copy on its stream would wait for (unmeasured:
no GPU was lent when this was written).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import logging
import threading
import time
from pathlib import Path
from typing import IO, Any, BinaryIO, Protocol, cast

import torch
from torch import Tensor

from trainguard.events import EventLog
from trainguard.recovery.failure import store
from trainguard.recovery.failure.batch_digest import batch_digest
from trainguard.recovery.failure.boundary import Boundary, StepBoundary
from trainguard.recovery.failure.shards import PeerShards, localize
from trainguard.recovery.snapshot import TrainingObjects, to_cpu
from trainguard.recovery.types import Stateful

logger = logging.getLogger(__name__)

FORMAT = 1


class StartBuffers(Protocol):
    """The buffers a step's forward changed, as they were at its start (the step's
    ``BufferKeeper``), by the unwrapped model's names."""

    def pre_step(self, step: int) -> dict[str, Tensor]: ...


class StateHolder(Protocol):
    def state_dict(self) -> dict[str, Any]: ...


def inner_name(name: str) -> str:
    """A buffer's name without the DDP / torch.compile wrappers' prefixes."""
    for prefix in ("module.", "_orig_mod."):
        while name.startswith(prefix):
            name = name[len(prefix) :]
    return name


def weights_digest(model_state: dict[str, Any], names: set[str]) -> str:
    """SHA-256 of the parameters' bytes (``names``; not the buffers, which each rank's own
    forward changes), in key order: survivors that agree hold the same."""
    digest = hashlib.sha256()
    for key in sorted(names & set(model_state)):
        value = model_state[key]
        if isinstance(value, Tensor):
            digest.update(key.encode())
            flat = value.detach().reshape(-1).contiguous()
            digest.update(flat.view(torch.uint8).numpy().data if flat.numel() else b"")  # no copy
    return digest.hexdigest()


class _HashingFile:
    """A binary file that hashes (SHA-256) what is written to it, in order: ``torch.save``
    writes its archive front to back, so the digest is the file's."""

    def __init__(self, handle: BinaryIO) -> None:
        self._handle = handle
        self._digest = hashlib.sha256()

    def write(self, data: bytes) -> int:
        self._digest.update(data)
        return self._handle.write(data)

    def flush(self) -> None:
        self._handle.flush()

    def hexdigest(self) -> str:
        return self._digest.hexdigest()


class FailureWriter:
    """Writes this rank's state at a failure (see the module docstring)."""

    def __init__(
        self,
        folder: Path,
        rank: int,
        world_size: int,
        objects: TrainingObjects,
        boundary: StepBoundary,
        buffers: StartBuffers | None,
        guard_state: Stateful,
        recovery_state: StateHolder,
        events: EventLog,
        seconds: float,
    ) -> None:
        self.folder = folder
        self.rank = rank
        self.world_size = world_size
        self.objects = objects
        self.boundary = boundary
        self.buffers = buffers
        self.guard_state = guard_state
        self.recovery_state = recovery_state
        self.events = events
        self.seconds = seconds
        self._once = threading.Lock()
        self._thread: threading.Thread | None = None
        self._deadline = 0.0
        self._cancelled = False
        self._tmp: Path | None = None
        self.saved: Path | None = None
        """The state written (None: none, or not yet)."""
        self.exiting = False
        """The watchdog ends the process with its own exit status once the state is written
        (``FailureState.save_for_exit``): a SIGTERM meanwhile leaves that to it."""
        self.shards: PeerShards | None = None
        """Sharded state (FSDP2): the snapshot shards to write too (``shards.py``)."""

    def save(self, trigger: str) -> Path | None:
        """Write the state once (the first trigger), waiting at most until its deadline.
        Never raises. Returns the state's path, None when nothing was written."""
        with self._once:
            if self._thread is None:
                self._deadline = time.monotonic() + self.seconds
                self._thread = threading.Thread(
                    target=self._run, args=(trigger,), name="trainguard-failure-state", daemon=True
                )
                self._thread.start()
            thread = self._thread
        thread.join(max(0.0, self._deadline - time.monotonic()))
        if thread.is_alive() and not self._cancelled:
            self._cancelled = True
            tmp = self._tmp
            if tmp is not None:
                with contextlib.suppress(OSError):
                    tmp.unlink()
            self._event(None, trigger, saved=False, reason=f"not done in {self.seconds:g} s")
        return self.saved

    def _run(self, trigger: str) -> None:
        start = time.perf_counter()
        try:
            if self.shards is not None:
                self._write_shards(trigger)
            boundary, generation = self.boundary.open_now()
            if boundary is None:
                self._event(None, trigger, saved=False, reason=self.boundary.why_closed())
                return
            payload = self._take(boundary)
            if not self.boundary.unchanged(generation):
                why = f"step {boundary.step} moved on while its state was copied"
                self._event(boundary, trigger, saved=False, reason=why)
                return
            self._write(boundary, payload, trigger, start)
        except Exception as exc:  # a failing process: never a new failure of ours
            logger.warning("trainguard: no state at the failure: %s", exc)
            self._event(None, trigger, saved=False, reason=f"{type(exc).__name__}: {exc}"[:300])

    def _take(self, boundary: Boundary) -> dict[str, Any]:
        """The state at the step's start, copied to the CPU (the boundary open)."""
        with _side_stream(self.objects.model):
            live = self.objects.state()
            state = localize(live) if self.shards is not None else to_cpu(live)
            buffers = self._start_buffers(boundary.step)
        return {
            "format": FORMAT,
            "step": boundary.step,
            "world_size": self.world_size,
            "state": state,
            "buffers": buffers,
            "rng": boundary.rng.state(),
            "rng_at": boundary.at,
            "data": {
                "epoch": boundary.epoch,
                "position": boundary.position,
                "loader": copy.deepcopy(boundary.loader_state),
                "batch_digest": batch_digest(boundary.batch),
            },
            "guard": copy.deepcopy(self.guard_state.state_dict()),
            "recovery": copy.deepcopy(self.recovery_state.state_dict()),
        }

    def _start_buffers(self, step: int) -> dict[str, Tensor]:
        """This rank's buffers as the step began: the ones its forward changed from their
        start copies, the others as they are (``checkpoint.restore_own_buffers``'s names)."""
        changed = self.buffers.pre_step(step) if self.buffers is not None else {}
        out = {}
        for name, buf in self.objects.model.named_buffers():
            if type(buf) is not Tensor:
                continue
            start = changed.get(inner_name(name), buf)
            out[name] = start.detach().to("cpu", copy=True)
        return out

    def _write(
        self, boundary: Boundary, payload: dict[str, Any], trigger: str, start: float
    ) -> None:
        nbytes = _tensor_bytes(payload)
        if not store.fits(self.folder, nbytes):
            self._event(
                boundary,
                trigger,
                saved=False,
                reason=f"{nbytes} bytes would not fit in {self.folder}",
            )
            return
        path = store.state_path(self.folder, boundary.step, self.rank)
        tmp = self._tmp = path.with_name(path.name + ".tmp")
        with tmp.open("wb") as handle:
            hashing = _HashingFile(handle)
            torch.save(payload, cast(IO[bytes], hashing))  # hashed as written, not read back
        if self._cancelled:
            with contextlib.suppress(OSError):
                tmp.unlink()
            return
        meta = {
            "format": FORMAT,
            "step": boundary.step,
            "rank": self.rank,
            "world_size": self.world_size,
            "bytes": tmp.stat().st_size,
            "sha256": hashing.hexdigest(),
            "digest": None
            if self.shards is not None
            else weights_digest(payload["state"]["model"], self._parameter_names()),
            "time": time.time(),
        }
        tmp.replace(path)
        store.write_meta(path, meta)
        self.saved = path
        seconds = round(time.perf_counter() - start, 3)
        self._event(
            boundary, trigger, saved=True, path=str(path), bytes=meta["bytes"], seconds=seconds
        )

    def _write_shards(self, trigger: str) -> None:
        """This rank's newest snapshot shard and the one it holds of the previous rank."""
        shards = self.shards
        assert shards is not None  # the caller checked
        copies = []
        if shards.own is not None:
            copies.append((shards.own[0], self.rank, shards.own[1]))
        if shards.held is not None:
            copies.append(shards.held)
        for step, owner, blob in copies:
            if not store.fits(self.folder, len(blob)):
                why = f"{len(blob)} bytes would not fit in {self.folder}"
                self._shard_event(step, owner, trigger, saved=False, reason=why)
                continue
            path = store.state_path(self.folder, step, owner, writer=self.rank)
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_bytes(blob)
            meta = {
                "format": FORMAT,
                "step": step,
                "rank": owner,
                "writer": self.rank,
                "world_size": self.world_size,
                "bytes": len(blob),
                "sha256": hashlib.sha256(blob).hexdigest(),
                "digest": None,
                "snapshot": True,
            }
            tmp.replace(path)
            store.write_meta(path, meta)
            self._shard_event(step, owner, trigger, saved=True, path=str(path))

    def _shard_event(self, step: int, owner: int, trigger: str, **fields: Any) -> None:
        with contextlib.suppress(Exception):
            self.events.write("failure_shard", step, owner=owner, trigger=trigger, **fields)

    def _parameter_names(self) -> set[str]:
        return {name for name, _ in self.objects.model.named_parameters()}

    def _event(self, boundary: Boundary | None, trigger: str, saved: bool, **fields: Any) -> None:
        step = boundary.step if boundary is not None else self.guard_state.step
        with contextlib.suppress(Exception):
            self.events.write("failure_state", step, saved=saved, trigger=trigger, **fields)


def _tensor_bytes(tree: Any) -> int:
    if isinstance(tree, Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(_tensor_bytes(v) for v in tree.values())
    if isinstance(tree, list | tuple):
        return sum(_tensor_bytes(v) for v in tree)
    return 64


@contextlib.contextmanager
def _side_stream(model: torch.nn.Module) -> Any:
    """Copies of CUDA tensors on a stream of their own (see the module docstring)."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    if device.type != "cuda":
        yield
        return
    side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    with torch.cuda.device(device), torch.cuda.stream(side):
        yield
