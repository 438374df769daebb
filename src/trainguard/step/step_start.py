"""Where a step really starts: its first training forward, not the loop's last fetch.

A fast loop fetches the next batch before the optimizer step (nanoGPT does), so the moment a
batch is handed out says nothing about which step it serves. What a capture and a skip need
is the state just before the step's *first forward*: the module buffers (``buffers.py``),
the RNG states (dropout draws from them), and the autocast state the forward runs under.

``StepStart`` puts a forward pre-hook on the guarded module, on the module inside its
wrappers (DDP, ``torch.compile``) and on that module's direct children (a LightningModule's
``training_step`` often calls its children, not ``forward``). The first hook call of a step
(grad enabled, the module in training mode: an evaluation pass under ``no_grad`` does not
count, but each of its forwards is progress for the hang watchdog) records the step's
start; the other calls of the step cost one comparison. Once a
step was started by the guarded module itself (the loop calls ``model(x)``), the children's
hooks are removed: a hook sends every call of its module down PyTorch's slow call path, a
cost a small model pays at every step. A later step that starts in a child only (the loop
changed how it calls the model) puts them back for the steps after it. Loops that hand
batches to ``guard.record_batch`` start the step there too (before the forward).

The hook also keeps references to the inputs of the step's training forwards of the
guarded module (one per micro-batch; not of a child, whose inputs may be activations),
until the next step starts: the loop's batch tensors stay alive that much longer (through
the optimizer step, when the loop already dropped them). A loop often changes a batch
between the fetch and the forward (a normalization, a transform, a device copy); a bad
step's capture compares these inputs with the batch ``watch()`` handed out, so that a NaN
made there is named as such (``step/evidence.py``), not taken for a transient fault when
the replay, which starts from the batch as fetched, comes out finite.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from trainguard.capture.batchtree import call_batch, call_versions
from trainguard.capture.rng import RngSnapshot, states_of
from trainguard.step.buffers import BufferKeeper
from trainguard.step.capturer import unwrap
from trainguard.step.types import ForwardDraws, IndicesOf, SamplerDraws
from trainguard.user_hooks import (
    add_forward_hooks,
    compiled_in_place,
    eager_module,
    prepare_eager,
)

logger = logging.getLogger(__name__)

ForwardInputs = tuple[tuple[Any, ...], dict[str, Any]]


@dataclass
class ForwardBatches:
    """A step's micro-batches taken from its training forwards' inputs (``forward_batches``)."""

    batches: list[Any]
    overwritten: list[int]
    """Positions of the micro-batches written in place since their forward."""


"""A forward's positional and keyword inputs (references)."""


def autocast_state(device_type: str) -> dict[str, Any]:
    """The autocast state in force now: ``{"enabled", "device_type", "dtype"}``, the first
    enabled of ``device_type`` and the CPU; disabled: ``dtype`` None."""
    for kind in autocast_kinds(device_type):
        if _autocast_enabled(kind):
            dtype = _autocast_dtype(kind)
            return {"enabled": True, "device_type": kind, "dtype": str(dtype).split(".")[-1]}
    return autocast_off(device_type)


def autocast_kinds(device_type: str) -> tuple[str, ...]:
    """The autocast kinds ``autocast_state`` looks at, in order: the model's, then the CPU."""
    return tuple(dict.fromkeys((device_type, "cpu")))


def autocast_off(device_type: str) -> dict[str, Any]:
    """``autocast_state`` when no autocast is in force."""
    return {"enabled": False, "device_type": device_type, "dtype": None}


def _autocast_enabled(kind: str) -> bool:
    try:
        return bool(torch.is_autocast_enabled(kind))
    except TypeError:  # torch < 2.4: no device argument
        if kind == "cpu":
            return bool(torch.is_autocast_cpu_enabled())
        return bool(torch.is_autocast_enabled())


def _autocast_dtype(kind: str) -> torch.dtype:
    try:
        return torch.get_autocast_dtype(kind)
    except (AttributeError, TypeError):  # torch < 2.4
        if kind == "cpu":
            return torch.get_autocast_cpu_dtype()
        return torch.get_autocast_gpu_dtype()


AUTOCAST_PROBES = 2
"""Forwards of a step, after its start outside autocast, that look at the autocast in force:
the model's own and its first hooked child's (inside an autocast the model's forward enters)."""


class StepStart:
    """Records, once per step, the state at the step's first training forward."""

    def __init__(
        self, model: nn.Module, step_of: Callable[[], int], restore_buffers: bool = True
    ) -> None:
        self._model = model
        self._inner = unwrap(model)
        self._step_of = step_of
        self.buffers = BufferKeeper(model if restore_buffers else nn.Module())
        self._device_type = _device_type(model)
        self._autocast_kinds = autocast_kinds(self._device_type)
        self._autocast_off = autocast_off(self._device_type)
        """Handed out at every step without autocast, as is (nobody changes it)."""
        self.step = -1
        """The step whose start was recorded last (-1: none yet)."""
        self.seen = False
        """Whether a hook has fired at all (then the stream need not take RNG states)."""
        self._rng: RngSnapshot | dict[str, Any] | None = None
        self.autocast: dict[str, Any] | None = None
        self._autocast_probes = 0
        """Later forwards of the step that may still look for its autocast (``_pre_hook``)."""
        self._forward_args: list[ForwardInputs] = []
        """The inputs of the recorded step's training forwards (references)."""
        self._forward_versions: list[list[int]] = []
        """Their tensors' version counters at each forward (``batchtree.call_versions``)."""
        self._args_module: nn.Module | None = None
        """The root module whose forwards ``_forward_args`` holds: the first of the step's
        training forwards (None: none yet, or the loop called a child)."""
        self.loader_draws: ForwardDraws | None = None
        """``trainguard run``: gives, at a training forward, what names its samples' dataset
        indices (``attach/loader_draws.py``); None: not followed (``watch()`` follows its own
        loader)."""
        self._forward_draws: list[IndicesOf | None] = []
        """What ``loader_draws`` gave at each of ``_forward_args``' forwards."""
        self.on_evaluation: Callable[[], None] | None = None
        """Runs at each forward of an evaluation (grad disabled or the model in eval mode):
        the watchdog counts it as progress, so that rank 0 evaluating alone while the
        others wait in the next step's collective is not taken for a hang."""
        self.on_recorded: Callable[[RngSnapshot], None] | None = None
        """Runs at each recorded start once its RNG states are taken (recovery's step-start
        record for a state at a failure: ``recovery/failure/``)."""
        self.on_begin: Callable[[], None] | None = None
        """Runs at each recorded start, before the states are taken: recovery's step boundary
        (snapshots and checkpoints at the true start of the step, also where the loop
        fetched the step's first batch during the step before)."""
        # the model, the innermost module whose hooks run eagerly (inside DDP, down to a
        # torch.compile wrapper: user_hooks.py) and the module inside all wrappers
        self._eager = eager_module(model)
        self._roots = list({id(m): m for m in (model, self._eager, self._inner)}.values())
        self._root_ids = frozenset(id(m) for m in self._roots)
        self._handles = [self._hook(m) for m in self._roots]
        self._child_handles: list[Any] = []
        self._hook_children()
        RngSnapshot.prepare()  # the raw layouts validated now, not inside the first step
        prepare_eager()  # a hook traced in a compiled function runs eagerly (user_hooks.py)

    @property
    def rng(self) -> dict[str, Any] | None:
        """The RNG states at the recorded step's start, as ``rng_state()`` gives them (built
        from the cheap per-step snapshot when first read: a bad step's capture, a rerun)."""
        return states_of(self._rng)

    @rng.setter
    def rng(self, value: dict[str, Any] | None) -> None:
        self._rng = value

    @property
    def rng_snapshot(self) -> RngSnapshot | dict[str, Any] | None:
        """``rng`` as taken (a snapshot not yet turned into a dict): kept lazy by holders."""
        return self._rng

    def _hook_children(self) -> None:
        """The direct children of the innermost eager module: none under ``torch.compile``
        (a wrapper's only child is a root; inside a compiled call a child's hooks would
        only add graph breaks, and taking them off later would recompile the model)."""
        parent = self._eager if not compiled_in_place(self._eager) else nn.Module()
        children = [m for m in parent.children() if id(m) not in self._root_ids]
        self._child_handles = [self._hook(m) for m in children]

    def _hook(self, module: nn.Module) -> Any:
        # the module inside a torch.compile wrapper: the wrapper's own hook does the work
        inside = module is self._inner and _is_compile_wrapper(self._eager)
        # first of the module's pre-hooks: the step's start (RNG, recovery's snapshot of the
        # weights) comes before FSDP2's unshard, where the parameters are still its shards
        return add_forward_hooks(module, pre=self._pre_hook, inside_compiled=inside, pre_first=True)

    def _pre_hook(self, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        step = self._step_of()
        if self.step == step:
            # A later micro-batch's forward, or the first forward of a step that started at a
            # record_batch or a fetch: its inputs are the step's too. (Under torch.compile
            # this runs eagerly, or not at all inside a compile wrapper: user_hooks.py.)
            if self._autocast_probes and torch.is_grad_enabled():
                # started outside the forward's autocast (Lightning's precision context,
                # entered after record_batch), or autocast entered inside the model's own
                # forward (accelerate wraps it): the root's or the first hooked child's
                # forward sees it (at most AUTOCAST_PROBES probes a step)
                self._autocast_probes -= 1
                self.autocast = self._autocast_now()
                if self.autocast is not self._autocast_off:
                    self._autocast_probes = 0
            if module is self._args_module or (
                self._args_module is None and id(module) in self._root_ids
            ):
                self._keep_inputs(module, args, kwargs)
            return
        if not torch.is_grad_enabled() or not self._inner.training:
            if self.on_evaluation is not None:
                self.on_evaluation()
            return
        self.seen = True
        self.begin(step)
        if id(module) in self._root_ids:
            self._forward_args, self._args_module = [(args, kwargs)], module
            self._forward_versions = [call_versions(args, kwargs)]
            if self.loader_draws is not None:
                self._forward_draws = [self.loader_draws(args, kwargs)]
            if self._child_handles:
                self._unhook_children()  # the loop calls the model itself: the roots suffice

    def _unhook_children(self) -> None:
        for handle in self._child_handles:
            handle.remove()
        self._child_handles = []

    def _keep_inputs(self, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        if torch.is_grad_enabled() and self._inner.training:  # not an evaluation pass
            self._forward_args.append((args, kwargs))
            self._forward_versions.append(call_versions(args, kwargs))
            if self.loader_draws is not None:
                self._forward_draws.append(self.loader_draws(args, kwargs))
            self._args_module = module

    def forward_inputs(self, step: int) -> list[ForwardInputs] | None:
        """The inputs of ``step``'s training forwards, ``(args, kwargs)`` per forward of the
        guarded module; None when ``step`` saw no such forward (the loop called a child)."""
        if self.step != step or self._args_module is None:
            return None
        return list(self._forward_args)

    def forward_batches(self, step: int) -> ForwardBatches | None:
        """``step``'s micro-batches as the guarded module was called with them (for a loop
        that neither iterates ``watch()`` nor calls ``record_batch``), and the positions of
        those whose tensors were written in place since their forward (a refilled input
        buffer: they hold a later batch's data). None: no such forward at ``step``."""
        if self.step != step or self._args_module is None:
            return None
        batches, overwritten = [], []
        for index, (args, kwargs) in enumerate(self._forward_args):
            batches.append(call_batch(args, kwargs))
            if call_versions(args, kwargs) != self._forward_versions[index]:
                overwritten.append(index)
        return ForwardBatches(batches, overwritten)

    def forward_draws(self, step: int) -> SamplerDraws | None:
        """What gives the dataset indices of ``step``'s training forwards, one list per
        forward (``loader_draws``; read only on a bad step); None when not followed, or when
        no forward of ``step`` was recorded."""
        draws = self._forward_draws
        if self.step != step or not draws or all(found is None for found in draws):
            return None
        return lambda: [found() if found is not None else None for found in draws]

    def draws_of(self, step: int) -> list[IndicesOf | None]:
        """``forward_draws``' record of ``step`` itself (empty when not followed or not
        ``step``): handed to a guard that takes this step over (``adopt_draws``)."""
        return list(self._forward_draws) if self.step == step else []

    def adopt_draws(self, draws: list[IndicesOf | None]) -> None:
        """The recorded step's draws, recorded before this guard existed (``trainguard
        run``'s first step, a replaced optimizer's guard)."""
        self._forward_draws = list(draws)

    def missed(self, step: int) -> None:
        """``step`` is being checked and no hook started it. For the next steps: the eager
        runner of traced hooks made, if dynamo came after the guard was built; with the
        children unhooked, the loop called a child directly: hooked again."""
        if self.step == step or not self._handles:
            return
        prepare_eager()  # a compiled function calling the model: its hooks run eagerly next
        if self.seen and not self._child_handles:
            logger.debug("trainguard: step %d started in no hooked module: children hooked", step)
            self._hook_children()

    def begin(self, step: int | None = None) -> None:
        """Record the step's start now (if not recorded yet): before its first forward."""
        step = self._step_of() if step is None else step
        if self.step == step:
            return
        self.step = step
        self._forward_args, self._args_module = [], None  # the hook sets them for its forward
        self._forward_versions, self._forward_draws = [], []
        if self.on_begin is not None:
            self.on_begin()
        self.buffers.begin(step)
        self._rng = RngSnapshot.take()
        if self.on_recorded is not None:
            self.on_recorded(self._rng)
        self.autocast = self._autocast_now()
        self._autocast_probes = 0 if self.autocast is not self._autocast_off else AUTOCAST_PROBES

    def _autocast_now(self) -> dict[str, Any]:
        """``autocast_state`` of the model's device type; the same dict at every step that
        runs without autocast (the usual one), so that step builds none."""
        for kind in self._autocast_kinds:
            if _autocast_enabled(kind):
                return autocast_state(self._device_type)
        return self._autocast_off

    def started(self, step: int) -> bool:
        return self.step == step

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._unhook_children()
        self._forward_args, self._args_module = [], None


def _is_compile_wrapper(module: nn.Module) -> bool:
    return type(module).__name__ == "OptimizedModule"


def _device_type(model: nn.Module) -> str:
    param = next(model.parameters(), None)
    return param.device.type if param is not None else "cpu"
