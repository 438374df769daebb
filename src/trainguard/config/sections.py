"""``GuardConfig``'s sections: one dataclass per part that reads its options (the spike rule,
recovery, the input check, replica health, transient faults, the hang watchdog, the
history). Each validates itself in ``__post_init__`` and names the option as the user sets
it (``spikes.warmup``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from trainguard.config.checks import (
    check_choice,
    check_flag,
    check_ignore_inputs,
    check_integer,
)
from trainguard.errors import ConfigError

NonFiniteAction = Literal["skip", "warn", "raise"]
EscalationAction = Literal["raise", "rollback"]
SpikeAction = Literal["warn", "skip", "rollback", "off"]
DivergenceAction = Literal["warn", "resync", "raise"]


@dataclass
class SpikeConfig:
    """Loss and gradient-norm spikes (docs/spikes.md); read by the spike rule
    (``step/spikewatch.py``). ``Guard(on_spike=...)`` sets ``action``."""

    action: SpikeAction = "warn"
    """``"warn"`` writes a ``spike`` event and lets the step through; ``"skip"`` skips the
    update like a non-finite step, escalating after ``max_consecutive`` in a row;
    ``"rollback"`` escalates at once (see ``RecoveryConfig.on_escalation``); ``"off"`` does
    not judge spikes."""
    z: float = 6.0
    """z-score (log space, against the running EMA) above which a value may be a spike."""
    ratio: float = 2.0
    """...and the value must also exceed this factor times the running (geometric) mean."""
    beta: float = 0.98
    """EMA weight of the running statistics (memory of about ``1 / (1 - beta)`` steps)."""
    warmup: int = 100
    """Steps of statistics gathered before any spike is judged."""
    max_consecutive: int = 3
    """With ``action="skip"``: spikes in a row that escalate instead of being skipped."""

    def __post_init__(self) -> None:
        check_choice("on_spike", self.action, SpikeAction)
        if not self.z > 0:
            raise ConfigError("spikes.z", f"got {self.z!r}; use a number > 0 (e.g. 6)")
        if not self.ratio >= 1:
            raise ConfigError("spikes.ratio", f"got {self.ratio!r}; use a number >= 1")
        if not 0 < self.beta < 1:
            raise ConfigError("spikes.beta", f"got {self.beta!r}; use 0 < beta < 1")
        check_integer("spikes.warmup", self.warmup, 0)
        check_integer("spikes.max_consecutive", self.max_consecutive, 1)


@dataclass
class RecoveryConfig:
    """Snapshots, rollback, checkpoints and resume (docs/recovery.md); read by
    ``recovery/``. ``Guard(on_escalation=, checkpoint_every=, keep_checkpoints=, resume=)``
    set the first four."""

    on_escalation: EscalationAction = "raise"
    """When the guard escalates: ``"raise"`` stops every rank with NonFiniteError;
    ``"rollback"`` restores the newest good snapshot on every rank, skips the batches that
    led to the failure and goes on; after ``max_rollbacks`` it raises."""
    checkpoint_every: int = 0
    """Steps between known-good checkpoints on disk (``run_dir/checkpoints``); 0 = off."""
    keep_checkpoints: int = 3
    """How many good checkpoints on disk to keep (the newest)."""
    resume: bool = False
    """Start from the newest good checkpoint in ``run_dir`` (a ``resume`` event says which)."""
    snapshot_every: int = 10
    """Steps between in-memory (CPU) snapshots, the rollback targets; 0 = off."""
    good_after: int = 2
    """Healthy steps that must follow a snapshot or checkpoint before it counts as good."""
    max_rollbacks: int = 3
    """Rollbacks without progress before the guard gives up and raises NonFiniteError."""
    skip_margin: int = 0
    """Extra batches skipped after a rollback, beyond those from the snapshot to the failure;
    those of the same ``watch()`` pass only (the margin stops at the end of the epoch)."""
    lr_backoff: float = 0.5
    """LR factor after the second rollback without progress (lr = schedule(step) x factor)."""
    lr_backoff_steps: int = 20
    """Steps over which the LR factor ramps back linearly to 1."""
    save_at_failure: bool = True
    """With ``resume=True``: when a peer fails, a hang is declared or the launcher ends this
    rank (SIGTERM), write this rank's state at the start of the step in flight to
    ``failure_state_dir``, and keep there a small record of each step's start (RNG states,
    data position: a few microseconds a step); the restart resumes from the freshest state
    every rank can be given (docs/recovery.md, "State at a failure")."""
    failure_state_dir: str | None = None
    """Where states at a failure are kept, in a per-job folder (mode 0700). None:
    ``/dev/shm/trainguard-<uid>`` where ``/dev/shm`` exists, else ``run_dir/failure-state``."""
    failure_save_seconds: float = 20.0
    """How long a rank may take to write its state at a failure; past it, it leaves nothing
    (torchrun's agent SIGKILLs its workers 30 s after its SIGTERM)."""

    def __post_init__(self) -> None:
        check_choice("on_escalation", self.on_escalation, EscalationAction)
        check_integer("checkpoint_every", self.checkpoint_every, 0)
        check_integer("keep_checkpoints", self.keep_checkpoints, 1)
        check_flag("resume", self.resume)
        for name in ("snapshot_every", "good_after", "skip_margin"):
            check_integer(f"recovery.{name}", getattr(self, name), 0)
        for name in ("max_rollbacks", "lr_backoff_steps"):
            check_integer(f"recovery.{name}", getattr(self, name), 1)
        check_flag("recovery.save_at_failure", self.save_at_failure)
        if self.failure_state_dir is not None and not isinstance(self.failure_state_dir, str):
            raise ConfigError(
                "recovery.failure_state_dir",
                f"got {self.failure_state_dir!r}; pass a folder path as a string, or None",
            )
        if not (
            isinstance(self.failure_save_seconds, int | float) and self.failure_save_seconds > 0
        ):
            raise ConfigError(
                "recovery.failure_save_seconds",
                f"got {self.failure_save_seconds!r}; use a number of seconds > 0",
            )
        if not 0 < self.lr_backoff <= 1:
            raise ConfigError(
                "recovery.lr_backoff", f"got {self.lr_backoff!r}; use a factor in (0, 1]"
            )
        if self.on_escalation == "rollback" and not (self.snapshot_every or self.checkpoint_every):
            raise ConfigError(
                "on_escalation",
                "rollback needs recovery.snapshot_every > 0 or checkpoint_every > 0",
            )

    @property
    def enabled(self) -> bool:
        """Whether recovery runs: rollback, checkpoints or resume."""
        return self.on_escalation == "rollback" or self.checkpoint_every > 0 or self.resume


@dataclass
class InputConfig:
    """The check of each batch's floating-point tensors for NaN/Inf (docs/guard.md); read by
    ``step/inputs.py``."""

    check: bool = True
    """Check every batch from ``watch()`` (and the model call's inputs under ``trainguard
    run``) on the device, no sync: a non-finite input marks the step bad on every rank
    (``bad_input``)."""
    ignore: tuple[str, ...] = ()
    """Batch entries left out, for inputs that hold NaN/Inf on purpose (an additive ``-inf``
    attention mask): a dict key or attribute name (``"attention_mask"``: that entry wherever
    it sits) or a whole path as the guard's messages name it (``"[0]['mask']"``)."""
    allow_masks: bool = True
    """An entry holding only 0 and -inf at a step whose losses and gradients are finite on
    every rank is taken for an additive mask: the step is not skipped and the entry is left
    out from then on (an ``input_mask`` event). False: such an input makes the step bad."""

    def __post_init__(self) -> None:
        check_flag("inputs.check", self.check)
        check_ignore_inputs(self.ignore)
        self.ignore = tuple(self.ignore)
        check_flag("inputs.allow_masks", self.allow_masks)


@dataclass
class HealthConfig:
    """Cross-rank health on the agreed numbers (docs/health.md); read by ``health/``.
    ``Guard(replica_check_every=, on_divergence=)`` set the first two."""

    replica_check_every: int = 5
    """Steps between checks that the replicated weights (DDP) agree across ranks: a
    fingerprint rides the step's agreement (0: off). Not for FSDP2 shards."""
    on_divergence: DivergenceAction = "warn"
    """When replicas disagree: ``"warn"``, ``"resync"`` (every rank takes a majority rank's
    parameters, buffers and optimizer state) or ``"raise"`` (``ReplicaDivergenceError``)."""
    detect_stragglers: bool = True
    """Time each rank's data wait and own compute per step and name a rank that slows the
    job (``straggler`` events)."""
    straggler_warmup: int = 10
    """Steps not judged at the start (compilation, allocator and loader warm-up)."""
    straggler_slowdown: float = 1.5
    """A rank is slow when its time is at least this factor of the median rank's."""

    def __post_init__(self) -> None:
        check_integer("replica_check_every", self.replica_check_every, 0)
        check_choice("on_divergence", self.on_divergence, DivergenceAction)
        check_flag("health.detect_stragglers", self.detect_stragglers)
        check_integer("health.straggler_warmup", self.straggler_warmup, 1)
        if not self.straggler_slowdown > 1.0:
            raise ConfigError(
                "health.straggler_slowdown",
                f"got {self.straggler_slowdown!r}; use a factor > 1",
            )


@dataclass
class RerunConfig:
    """Transient faults, with ``Guard(rerun=loss_fn)``; read by ``step/transient.py``."""

    suspect_host_after: int = 3
    """Transient faults (finite when rerun) on one host within 1,000 steps after which the
    host is suspect: a ``suspect_host`` event and every rank exits with 94 (0: off)."""

    def __post_init__(self) -> None:
        check_integer("rerun.suspect_host_after", self.suspect_host_after, 0)


@dataclass
class HangConfig:
    """The hang watchdog (docs/hangs.md); read by ``hang/``. ``Guard(hang_timeout=)`` sets
    ``timeout``."""

    timeout: float | None = None
    """Seconds without progress before a hang is declared; None learns it; 0 disables."""
    mark_saves: bool = True
    """A ``torch.save`` on the loop's thread runs in a ``save`` phase: one rank writing a long
    checkpoint while the others wait is not a hang. False: the loop marks its saves."""

    def __post_init__(self) -> None:
        if self.timeout is not None and not self.timeout >= 0:
            raise ConfigError(
                "hang_timeout", f"got {self.timeout!r}; use seconds > 0, 0 to disable, or None"
            )
        check_flag("hang.mark_saves", self.mark_saves)


@dataclass
class HistoryConfig:
    """The step records: the ring written into bundles and the metrics log; read by
    ``step/history.py`` and ``step/metrics_log.py``."""

    steps: int = 256
    """Recent step records (losses, gradient norm, decision, lr) kept in memory and written
    into a capture bundle as ``history.json``."""
    metrics_lines_per_second: float = 100.0
    """The most lines a second the metrics log (``metrics/rank-0.jsonl``) takes of a fast
    loop, past its first 1,000 steps (every step that is not ``ok`` still); ``math.inf``:
    every step."""

    def __post_init__(self) -> None:
        check_integer("history.steps", self.steps, 1)
        if not self.metrics_lines_per_second > 0:
            raise ConfigError(
                "history.metrics_lines_per_second",
                f"got {self.metrics_lines_per_second!r}; use a number > 0 (math.inf: every step)",
            )
