"""GuardConfig: every Guard option, documented and validated in one place."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from trainguard.errors import ConfigError
from trainguard.run_identity import check_run_option

NonFiniteAction = Literal["skip", "warn", "raise"]
_ACTIONS = ("skip", "warn", "raise")
EscalationAction = Literal["raise", "rollback"]
SpikeAction = Literal["warn", "skip", "rollback", "off"]
DivergenceAction = Literal["warn", "resync", "raise"]
_DIVERGENCE_ACTIONS = ("warn", "resync", "raise")
_SPIKE_ACTIONS = ("warn", "skip", "rollback", "off")


@dataclass
class GuardConfig:
    """Options of :class:`trainguard.Guard`. Invalid values raise :class:`ConfigError`."""

    run_dir: Path | str = "runs/trainguard"
    """Folder for ``events/``, ``captures/`` and ``hangs/``; every rank must pass the same path."""

    on_nonfinite: NonFiniteAction = "skip"
    """What a non-finite step does: ``"skip"`` clears the gradients (set to None) and returns
    False; ``"warn"`` logs, writes an event and returns False, leaving the gradients alone;
    ``"raise"`` raises :class:`NonFiniteError` on every rank."""

    max_consecutive: int = 5
    """Bad steps in a row before the guard escalates (NonFiniteError on every rank)."""

    capture: bool = True
    """Write a replay bundle for the first bad step and on escalation."""

    grad_clip: float | None = None
    """Max total gradient norm; applied in the same pass that checks the gradients. None or
    0.0 (the "off" of nanoGPT's and many loops' own ``grad_clip`` option): no clipping."""

    hang_timeout: float | None = None
    """Seconds without progress before a hang is declared; None learns it; 0 disables."""

    mark_saves: bool = True
    """While the watchdog runs, a ``torch.save`` on the loop's thread runs in a ``save``
    phase (docs/hangs.md): one rank writing a long checkpoint while the others wait is not
    taken for a hang. False: the loop marks its saves itself (``guard.phase``)."""

    accumulation_steps: int = 1
    """Micro-batches per optimizer step; ``watch()`` groups batches by this count."""

    min_loss_scale: float = 1.0
    """With a GradScaler: an overflow while the loss scale is below this escalates."""

    max_recorded_steps: int = 100
    """How many bad step numbers ``guard.state.nonfinite_steps`` keeps (the most recent)."""

    history_steps: int = 256
    """How many recent step records (losses, gradient norm, decision, lr) the guard keeps in
    memory and writes into a capture bundle as ``history.json``."""

    metrics_lines_per_second: float = 100.0
    """The most lines a second the metrics log (``metrics/rank-0.jsonl``) takes of a fast
    loop, past the first 1,000 steps the process records: a loop faster than this writes
    every 2nd, 5th, 10th, 20th... step, whichever keeps it under (every step that is not
    ``ok`` still). A step of 10 ms or more keeps every line; ``math.inf``: every step
    (``step/metrics.py``)."""

    on_escalation: EscalationAction = "raise"
    """When the guard escalates: ``"raise"`` stops every rank with NonFiniteError;
    ``"rollback"`` restores the newest good snapshot on every rank, skips the batches that led
    to the failure and goes on (see docs/recovery.md); after ``max_rollbacks`` it raises."""

    checkpoint_every: int = 0
    """Steps between known-good checkpoints on disk (``run_dir/checkpoints``); 0 = off."""

    keep_checkpoints: int = 3
    """How many good checkpoints on disk to keep (the newest)."""

    resume: bool = False
    """Start from the newest good checkpoint in ``run_dir`` (a ``resume`` event says which)."""

    run: str | None = None
    """Which run of ``run_dir`` this guard writes (every event carries its id; see
    ``trainguard.run_identity``). None: a new run, unless torchrun restarts the job or
    ``resume`` is set, which continue the latest; ``"new"``, ``"continue"`` (the latest run),
    or a run id to continue."""

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

    zero_lr_steps: int = 5
    """Steps at LR 0 after the optimizer moments are reset (the ladder's last rung)."""

    loss_tolerance: float = 0.5
    """Relative difference between the first loss after a rollback or resume and the one
    recorded with the snapshot above which a ``loss_mismatch`` event is written."""

    on_spike: SpikeAction = "warn"
    """What a loss or gradient-norm spike does (docs/spikes.md): ``"warn"`` writes a ``spike``
    event and lets the step through; ``"skip"`` skips the update like a non-finite step
    (gradients cleared, ``check()`` False), escalating after ``spike_max_consecutive`` in a
    row; ``"rollback"`` escalates at once (as repeated non-finite steps do, see
    ``on_escalation``); ``"off"`` does not judge spikes."""

    spike_z: float = 6.0
    """z-score (log space, against the running EMA) above which a value may be a spike."""

    spike_ratio: float = 2.0
    """...and the value must also exceed this factor times the running (geometric) mean."""

    spike_beta: float = 0.98
    """EMA weight of the running statistics (memory of about ``1 / (1 - beta)`` steps)."""

    spike_warmup: int = 100
    """Steps of statistics gathered before any spike is judged."""

    spike_grace: int = 50
    """Steps not judged after the learning rate (as the host sees it) jumps by over 10%."""

    spike_max_consecutive: int = 3
    """With ``on_spike="skip"``: spikes in a row that escalate instead of being skipped."""

    check_inputs: bool = True
    """Check each floating-point tensor of every batch from ``watch()`` for NaN/Inf (on the
    device, no sync): a non-finite input marks the step bad on every rank (``bad_input``)."""

    ignore_inputs: tuple[str, ...] = ()
    """Batch entries the input check leaves out, for inputs that hold NaN/Inf on purpose (an
    additive ``-inf`` attention mask): a dict key or attribute name (``"attention_mask"``:
    that entry wherever it sits in the batch) or a whole path as the guard's messages name
    it (``"[0]['mask']"``). The rest of the batch stays checked; ``check_inputs=False``
    turns the whole check off."""

    allow_masks: bool = True
    """An input entry holding only 0 and -inf (an additive attention or padding mask: the
    ``nn.Transformer`` tutorial's ``src_mask``) at a step whose losses and gradients are finite
    on every rank is taken for a mask: the step is not skipped, and that entry is left out of
    the input check from then on (an ``input_mask`` event and one warning name it). False:
    such an input makes the step bad, as any non-finite input does."""

    replica_check_every: int = 100
    """Steps between checks that the replicated weights (DDP, or one process per replica)
    agree across ranks: a fingerprint rides the step's agreement (0: off). Not for FSDP2
    shards, which differ by design."""

    on_divergence: DivergenceAction = "warn"
    """When replicas disagree: ``"warn"`` (a ``replica_divergence`` event and a log line),
    ``"resync"`` (every rank takes a majority rank's parameters, buffers and optimizer state
    by broadcast, then goes on) or ``"raise"`` (``ReplicaDivergenceError`` on every rank)."""

    detect_stragglers: bool = True
    """Time each rank's data wait and own compute per step (they ride the step's agreement)
    and name a rank that slows the job (``straggler`` events; ``health/stragglers.py``)."""

    straggler_window: int = 40
    """Steps over which a rank must be slow, in 3/4 of them, before it is named (40: a
    busy machine's scheduling noise stays under the floors; ``docs/health.md``)."""

    straggler_warmup: int = 10
    """Steps not judged at the start (compilation, allocator and loader warm-up)."""

    straggler_slowdown: float = 1.5
    """A rank is slow when its time (in 3/4 of the window's steps) is at least this factor of
    the median rank's median time..."""

    straggler_min_lost: float = 0.01
    """...and the job waits for it at least this many seconds per step."""

    suspect_host_after: int = 3
    """With ``rerun``: transient faults (finite when rerun) on one host, within
    ``suspect_host_window`` steps, after which the host is suspect: a ``suspect_host`` event
    and every rank exits with ``EXIT_SUSPECT_HOST`` (94) so a scheduler can drain it (0: off)."""

    suspect_host_window: int = 1000
    """Steps over which ``suspect_host_after`` counts a host's transient faults."""

    restore_buffers: bool = True
    """Put back the module buffers a step's forward wrote (BatchNorm statistics, counters)
    whenever the step is not applied (skip, spike skip, fp16 overflow, escalation,
    rollback), so a skipped step leaves the model as if its batch never came. Only buffers
    the forward changes are copied, at the step's first forward (``step/buffers.py``)."""

    extra: dict[str, object] = field(default_factory=dict)
    """Free-form metadata written into the ``start`` event (experiment name, git sha...)."""

    def __post_init__(self) -> None:
        self.run_dir = Path(self.run_dir)
        if self.on_nonfinite not in _ACTIONS:
            raise ConfigError(
                "on_nonfinite", f"got {self.on_nonfinite!r}; use one of {', '.join(_ACTIONS)}"
            )
        _check_health(self)
        for name in ("restore_buffers", "mark_saves"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(name, f"got {getattr(self, name)!r}; use True or False")
        if not isinstance(self.max_consecutive, int) or self.max_consecutive < 1:
            raise ConfigError(
                "max_consecutive", f"got {self.max_consecutive!r}; use an integer >= 1"
            )
        if self.grad_clip == 0 and not isinstance(self.grad_clip, bool):
            self.grad_clip = None  # the loops' own "off"
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise ConfigError(
                "grad_clip", f"got {self.grad_clip!r}; use a positive number, or None or 0 (off)"
            )
        if self.hang_timeout is not None and self.hang_timeout < 0:
            raise ConfigError(
                "hang_timeout", f"got {self.hang_timeout!r}; use seconds > 0, 0 to disable, or None"
            )
        if not isinstance(self.accumulation_steps, int) or self.accumulation_steps < 1:
            raise ConfigError(
                "accumulation_steps", f"got {self.accumulation_steps!r}; use an integer >= 1"
            )
        if not self.min_loss_scale > 0:
            raise ConfigError("min_loss_scale", f"got {self.min_loss_scale!r}; use a number > 0")
        if self.max_recorded_steps < 1:
            raise ConfigError("max_recorded_steps", "use an integer >= 1")
        if not isinstance(self.history_steps, int) or self.history_steps < 1:
            raise ConfigError("history_steps", f"got {self.history_steps!r}; use an integer >= 1")
        if not self.metrics_lines_per_second > 0:
            raise ConfigError(
                "metrics_lines_per_second",
                f"got {self.metrics_lines_per_second!r}; use a number > 0 (math.inf: every step)",
            )
        try:
            check_run_option(self.run)
        except ValueError as exc:
            raise ConfigError("run", str(exc)) from None
        check_ignore_inputs(self.ignore_inputs)
        self.ignore_inputs = tuple(self.ignore_inputs)
        _check_recovery(self)
        _check_spikes(self)

    def start_fields(self) -> dict[str, object]:
        """What the ``start`` event records of the options (and ``extra``)."""
        return {
            "on_nonfinite": self.on_nonfinite,
            "max_consecutive": self.max_consecutive,
            "grad_clip": self.grad_clip,
            "accumulation_steps": self.accumulation_steps,
            **self.extra,
        }


def _check_health(config: GuardConfig) -> None:
    if not isinstance(config.replica_check_every, int) or config.replica_check_every < 0:
        raise ConfigError(
            "replica_check_every",
            f"got {config.replica_check_every!r}; use an integer >= 0 (0 turns it off)",
        )
    if config.on_divergence not in _DIVERGENCE_ACTIONS:
        raise ConfigError(
            "on_divergence",
            f"got {config.on_divergence!r}; use one of {', '.join(_DIVERGENCE_ACTIONS)}",
        )
    for name in ("straggler_window", "straggler_warmup", "suspect_host_window"):
        value = getattr(config, name)
        if not isinstance(value, int) or value < 1:
            raise ConfigError(name, f"got {value!r}; use an integer >= 1")
    if not isinstance(config.suspect_host_after, int) or config.suspect_host_after < 0:
        raise ConfigError(
            "suspect_host_after", f"got {config.suspect_host_after!r}; use an integer >= 0"
        )
    if not config.straggler_slowdown > 1.0:
        raise ConfigError(
            "straggler_slowdown", f"got {config.straggler_slowdown!r}; use a factor > 1"
        )
    if not config.straggler_min_lost >= 0.0:
        raise ConfigError(
            "straggler_min_lost", f"got {config.straggler_min_lost!r}; use seconds >= 0"
        )


def check_ignore_inputs(names: object) -> None:
    """``ignore_inputs`` must be a tuple (or list) of non-empty names (``trainguard run``'s
    options are checked by it too)."""
    if isinstance(names, str):
        raise ConfigError(
            "ignore_inputs",
            f"got the string {names!r}; use a tuple of names: ignore_inputs=({names!r},)",
        )
    if not isinstance(names, tuple | list) or not all(
        isinstance(name, str) and name for name in names
    ):
        raise ConfigError(
            "ignore_inputs",
            f"got {names!r}; use a tuple of batch keys or paths, e.g. ('attention_mask',)",
        )


def _check_recovery(config: GuardConfig) -> None:
    if config.on_escalation not in ("raise", "rollback"):
        raise ConfigError("on_escalation", f"got {config.on_escalation!r}; use raise or rollback")
    for name in ("checkpoint_every", "snapshot_every", "good_after", "skip_margin"):
        value = getattr(config, name)
        if not isinstance(value, int) or value < 0:
            raise ConfigError(name, f"got {value!r}; use an integer >= 0")
    if not isinstance(config.zero_lr_steps, int) or config.zero_lr_steps < 0:
        raise ConfigError("zero_lr_steps", f"got {config.zero_lr_steps!r}; use an integer >= 0")
    for name in ("keep_checkpoints", "max_rollbacks", "lr_backoff_steps"):
        value = getattr(config, name)
        if not isinstance(value, int) or value < 1:
            raise ConfigError(name, f"got {value!r}; use an integer >= 1")
    if not 0 < config.lr_backoff <= 1:
        raise ConfigError("lr_backoff", f"got {config.lr_backoff!r}; use a factor in (0, 1]")
    no_target = config.snapshot_every == 0 and config.checkpoint_every == 0
    if config.on_escalation == "rollback" and no_target:
        raise ConfigError(
            "on_escalation", "rollback needs snapshot_every > 0 or checkpoint_every > 0"
        )


def _check_spikes(config: GuardConfig) -> None:
    if config.on_spike not in _SPIKE_ACTIONS:
        choices = ", ".join(_SPIKE_ACTIONS)
        raise ConfigError("on_spike", f"got {config.on_spike!r}; use one of {choices}")
    if not config.spike_z > 0:
        raise ConfigError("spike_z", f"got {config.spike_z!r}; use a number > 0 (e.g. 6)")
    if not config.spike_ratio >= 1:
        raise ConfigError("spike_ratio", f"got {config.spike_ratio!r}; use a number >= 1")
    if not 0 < config.spike_beta < 1:
        raise ConfigError("spike_beta", f"got {config.spike_beta!r}; use 0 < beta < 1")
    for name in ("spike_warmup", "spike_grace"):
        value = getattr(config, name)
        if not isinstance(value, int) or value < 0:
            raise ConfigError(name, f"got {value!r}; use an integer >= 0")
    if not isinstance(config.spike_max_consecutive, int) or config.spike_max_consecutive < 1:
        raise ConfigError(
            "spike_max_consecutive", f"got {config.spike_max_consecutive!r}; use an integer >= 1"
        )


def more_options(options: dict[str, object]) -> dict[str, object]:
    """``Guard``'s keywords beyond its own parameters: any other ``GuardConfig`` option (every
    option goes in as a keyword); an unknown one is a ``ConfigError`` naming it, and the
    option closest to it."""
    fields = GuardConfig.__dataclass_fields__
    for name in options:
        if name not in fields or name == "extra":
            close = difflib.get_close_matches(name, list(fields), n=1)
            hint = f"did you mean {close[0]}=? " if close else ""
            if name == "extra":  # not beside extra_state: pass it in a config
                hint = "pass it as config=GuardConfig(..., extra={...}); "
            raise ConfigError(
                name,
                f"Guard has no option {name!r}; {hint}the options are trainguard.GuardConfig's "
                "fields (docs/guard.md)",
            )
    return options


def config_of(
    config: GuardConfig | None, options: dict[str, object], defaults: dict[str, object]
) -> GuardConfig:
    """``Guard``'s configuration: ``config`` when given, else one built from the keyword
    ``options``. Keywords changed from their ``defaults`` beside ``config`` are refused,
    not dropped (which one would win is a guess)."""
    if config is None:
        return GuardConfig(**options)  # type: ignore[arg-type]
    given = [
        name for name, value in options.items() if name not in defaults or value != defaults[name]
    ]
    if given:
        keywords = ", ".join(f"{name}=..." for name in given)
        raise ConfigError(
            "config",
            f"Guard(..., {keywords}, config=GuardConfig(...)): pass the options either as "
            f"keywords or in the GuardConfig, not both; move {', '.join(given)} into the "
            "GuardConfig",
        )
    return config
