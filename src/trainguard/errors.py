"""Exceptions raised by trainguard.

Every exception derives from :class:`TrainGuardError`, so ``except tg.TrainGuardError``
catches all of them::

    TrainGuardError
    ├── ConfigError          a Guard option or argument is invalid (also a ValueError)
    ├── NonFiniteError       a step was non-finite and the policy says stop (every rank)
    │   ├── LossScaleCollapseError  fp16 loss scale fell below the configured floor (every rank)
    │   └── SpikeError       loss or gradient-norm spikes escalated (``on_spike``, every rank)
    ├── BundleError          a capture bundle is missing, damaged or of another format
    ├── ReplayError          a bundle cannot be replayed with the given factory
    ├── PeerFailureError     another rank failed and published why
    └── ReplicaDivergenceError  replicated weights differ across ranks (every rank)
"""

from __future__ import annotations

from pathlib import Path


class TrainGuardError(Exception):
    """Base class of every trainguard exception."""


class ConfigError(TrainGuardError, ValueError):
    """A Guard option or API argument is invalid. The message names the option and the fix."""

    def __init__(self, option: str, message: str) -> None:
        super().__init__(f"{option}: {message}")
        self.option = option
        self.detail = message

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.option, self.detail))


class NonFiniteError(TrainGuardError):
    """A step's loss or gradients were not finite and the policy stops the run.

    Raised on every rank at the same step, so no rank is left waiting in a collective.
    """

    def __init__(
        self,
        message: str,
        *,
        step: int,
        ranks: list[int],
        bundle: Path | None = None,
    ) -> None:
        super().__init__(message)
        self.step = step
        self.ranks = list(ranks)
        self.bundle = bundle

    def __reduce__(self) -> tuple[object, ...]:  # picklable across processes
        return (_rebuild_nonfinite, (type(self), str(self), self.step, self.ranks, self.bundle))


def _rebuild_nonfinite(
    cls: type[NonFiniteError], message: str, step: int, ranks: list[int], bundle: Path | None
) -> NonFiniteError:
    return cls(message, step=step, ranks=ranks, bundle=bundle)


class LossScaleCollapseError(NonFiniteError):
    """The fp16 loss scale fell below ``min_loss_scale``: the gradients overflow at any scale."""


class SpikeError(NonFiniteError):
    """Loss or gradient-norm spikes escalated (``on_spike``): raised on every rank. The
    step's values were finite; it is a ``NonFiniteError`` so that one ``except`` stops on
    every escalation."""


class BundleError(TrainGuardError):
    """A capture bundle cannot be read: missing files, wrong format or version, bad checksum."""

    def __init__(self, path: Path | str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = Path(path)
        self.detail = message

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.path, self.detail))


class ReplayError(TrainGuardError):
    """A bundle cannot be replayed: the factory or the weights do not fit."""


class PeerFailureError(TrainGuardError):
    """Another rank failed (exception, death or hang) and this rank stops because of it."""

    def __init__(self, message: str, *, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild_peer_failure, (str(self), self.rank))


def _rebuild_peer_failure(message: str, rank: int | None) -> PeerFailureError:
    return PeerFailureError(message, rank=rank)


class ReplicaDivergenceError(TrainGuardError):
    """The replicated weights differ across ranks and ``on_divergence="raise"`` stops the run.

    Raised on every rank at the same step. ``ranks``: the ranks that disagree with the
    majority (every rank on a tie); ``params``: the parameters whose values differ.
    """

    def __init__(self, message: str, *, step: int, ranks: list[int], params: list[str]) -> None:
        super().__init__(message)
        self.step = step
        self.ranks = list(ranks)
        self.params = list(params)

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild_divergence, (str(self), self.step, self.ranks, self.params))


def _rebuild_divergence(
    message: str, step: int, ranks: list[int], params: list[str]
) -> ReplicaDivergenceError:
    return ReplicaDivergenceError(message, step=step, ranks=ranks, params=params)
