"""Re-run one captured training step: forward, loss and backward, from the captured state.

Before every run the RNG states and the model's buffers (e.g. BatchNorm statistics, which a
forward pass in train mode changes) are restored and the gradients are dropped, so runs are
independent and comparable bit for bit. The weights are never updated. The forward pass
and the loss run under the step's autocast state (``autocast.py``), the backward outside it.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import _disable_current_modes

from trainguard.capture import batchcodec, batchtree
from trainguard.capture.rng import rng_state, set_rng_state
from trainguard.errors import ReplayError
from trainguard.numerics import norm_or_inf, stored_values
from trainguard.replay.autocast import OFF, Autocast
from trainguard.replay.localize import NonFiniteTracer

LossFn = Callable[[nn.Module, Any], Tensor]


@dataclass
class RunResult:
    """One run of the step (or of a part of it)."""

    losses: list[float] = field(default_factory=list)
    loss_finite: bool = True
    grads_finite: bool = True
    grad_norm: float = 0.0
    bad_params: list[str] = field(default_factory=list)
    bits: tuple[int, ...] = ()
    """The losses and the squared gradient norm as raw float64 bits (determinism check)."""
    error: str | None = None
    first_bad_micro: int | None = None
    loss_tensor: Tensor | None = field(default=None, repr=False)
    """The last micro-batch's loss (``keep_loss=True``), for the tracer's lookup."""

    @property
    def finite(self) -> bool:
        return self.loss_finite and self.grads_finite and self.error is None

    @property
    def bad(self) -> bool:
        """Non-finite (a run that raised is not counted as bad)."""
        return self.error is None and not (self.loss_finite and self.grads_finite)


def _bits(value: Tensor) -> int:
    return int(value.detach().reshape(()).double().view(torch.int64).item())


class StepRunner:
    """Runs ``loss_fn(model, micro_batch)`` + backward for the captured micro-batches."""

    def __init__(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        micro_batches: Sequence[Any],
        rng: dict[str, Any] | None,
        device: torch.device,
        autocast: Autocast = OFF,
    ) -> None:
        self.model = model
        self.autocast = autocast
        self.loss_fn = loss_fn
        self.device = device
        self.micro_batches = [
            batchtree.map_tensors(b, lambda t: t.to(device)) for b in micro_batches
        ]
        self._rng = rng
        self._micro_rng: list[dict[str, Any] | None] = [None] * len(micro_batches)
        self._buffers = {name: buf.detach().clone() for name, buf in model.named_buffers()}
        self._params = [(name, p) for name, p in model.named_parameters() if p.requires_grad]

    @contextmanager
    def autocast_as(self, autocast: Autocast) -> Iterator[None]:
        """Run under ``autocast`` inside the ``with`` block (e.g. ``OFF``: float32)."""
        saved, self.autocast = self.autocast, autocast
        try:
            yield
        finally:
            self.autocast = saved

    @property
    def params(self) -> list[tuple[str, nn.Parameter]]:
        """The parameters that get gradients, by name."""
        return self._params

    def restore_buffers(self) -> None:
        """Put the model's buffers back as they were when the runner was made (a run's
        forward writes them: BatchNorm's statistics, made non-finite by a bad batch)."""
        with torch.no_grad():
            for name, buf in self.model.named_buffers():
                saved = self._buffers.get(name)
                if saved is not None and saved.shape == buf.shape:
                    buf.copy_(saved)

    def _reset(self, rng: dict[str, Any] | None) -> None:
        if rng is not None:
            set_rng_state(rng)
        self.restore_buffers()
        for _, param in self._params:
            param.grad = None

    def run(
        self,
        micro: int | None = None,
        positions: Sequence[int] | None = None,
        backward: bool = True,
        tracer: NonFiniteTracer | None = None,
        strict: bool = False,
        keep_loss: bool = False,
    ) -> RunResult:
        """Run every micro-batch (``micro=None``) or one, optionally on a subset of samples.

        ``strict``: an exception from loss_fn becomes a ReplayError instead of a result.
        """
        indices = range(len(self.micro_batches)) if micro is None else [micro]
        self._reset(self._rng if micro is None or micro == 0 else self._micro_rng[micro])
        result = RunResult()
        sums: list[Tensor] = []
        for m in indices:
            if micro is None:
                self._micro_rng[m] = rng_state()
            batch = self.micro_batches[m]
            if positions is not None:
                size = batchtree.batch_size(batch)
                batch = batchtree.select(batch, positions, size) if size else batch
            try:
                loss = self._forward_backward(batch, backward, tracer)
            except ReplayError:
                raise
            except Exception as exc:
                if strict:
                    hint = (
                        ""
                        if isinstance(exc, batchcodec.UnrebuiltTypeError)
                        else "; check that --factory builds the model and loss of the training run"
                    )
                    raise ReplayError(
                        f"loss_fn failed on micro-batch {m} of the captured step "
                        f"({type(exc).__name__}: {_one_line(exc)}){hint}"
                    ) from exc
                result.error = f"{type(exc).__name__}: {_one_line(exc)}"
                return result
            if keep_loss:
                result.loss_tensor = loss
            with _untraced(tracer):
                sums.append(loss.detach().double())
                value = float(loss.detach().float())
            result.losses.append(value)
            if not math.isfinite(value) and result.loss_finite:
                result.loss_finite = False
                result.first_bad_micro = m
        with _untraced(tracer):  # the replay's own reads are no hop of the step's values
            self._read_grads(result, sums, backward)
        if result.first_bad_micro is None and not result.grads_finite:
            # the loss was finite: which micro-batch's own gradients are bad (a run of one
            # micro-batch is its own answer; it must not search again: no recursion)
            result.first_bad_micro = micro if micro is not None else self._first_bad_grad_micro()
        return result

    def _forward_backward(
        self, batch: Any, backward: bool, tracer: NonFiniteTracer | None
    ) -> Tensor:
        if tracer is not None:
            tracer.phase = "forward"
        with self.autocast.context():
            loss = self.loss_fn(self.model, batch)
        if not isinstance(loss, Tensor) or loss.numel() != 1:
            kind = (
                type(loss).__name__ if not isinstance(loss, Tensor) else f"shape {list(loss.shape)}"
            )
            raise ReplayError(f"loss_fn must return a scalar tensor, got {kind}")
        if backward and loss.requires_grad:
            if tracer is not None:
                tracer.phase = "backward"
            loss.backward()  # type: ignore[no-untyped-call]
        return loss

    def _read_grads(self, result: RunResult, sums: list[Tensor], backward: bool) -> None:
        sumsq = torch.zeros((), dtype=torch.float64, device=self.device)
        if backward:
            for name, param in self._params:
                if param.grad is None:
                    continue
                grad = stored_values(param.grad.detach())  # a sparse gradient's values
                if not bool(torch.isfinite(grad).all()):
                    result.bad_params.append(name)
                sumsq = sumsq + grad.double().pow(2).sum()
        result.grads_finite = not result.bad_params
        result.grad_norm = norm_or_inf(math.sqrt(float(sumsq)))
        result.bits = (*(_bits(s) for s in sums), _bits(sumsq))

    def _first_bad_grad_micro(self) -> int | None:
        """With gradient accumulation: the first micro-batch whose own gradients are bad."""
        if len(self.micro_batches) == 1:
            return 0
        for m in range(len(self.micro_batches)):
            if self.run(micro=m).bad:
                return m
        return None


def _untraced(tracer: NonFiniteTracer | None) -> contextlib.AbstractContextManager[Any]:
    """Outside the tracer (a dispatch mode) while the replay reads the loss and gradients."""
    if tracer is None:
        return contextlib.nullcontext()
    return _disable_current_modes()


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__
