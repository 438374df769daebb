"""The Guard's options: the core's own fields, then one section per part that reads them.

``GuardConfig`` holds what the step itself uses (the non-finite policy, clipping, the run
dir...) and a section per part, each owned by its one reader: ``spikes`` (the spike rule),
``recovery`` (snapshots, rollback, checkpoints, resume), ``inputs`` (the input check),
``health`` (replica agreement, stragglers), ``rerun`` (transient faults), ``hang`` (the
watchdog) and ``history`` (the step records and the metrics log). Each section validates
itself and names the option in its error as the user sets it.

One path takes options by name (``options_config``): ``Guard``'s keywords, the CLI's
``trainguard run --option NAME=VALUE``, and the Lightning and Hugging Face integrations all
call it. A name is a ``Guard`` keyword (``on_spike``, ``checkpoint_every``, ...: ``KEYWORDS``),
a core field (``capture``), or ``section.field`` (``spikes.warmup``); a section may also be
given whole (``spikes=SpikeConfig(...)``). An unknown name is a ``ConfigError`` naming the
closest known one.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from trainguard.errors import ConfigError
from trainguard.runs.identity import check_run_option

NonFiniteAction = Literal["skip", "warn", "raise"]
EscalationAction = Literal["raise", "rollback"]
SpikeAction = Literal["warn", "skip", "rollback", "off"]
DivergenceAction = Literal["warn", "resync", "raise"]


def _choice(option: str, value: object, action: Any) -> None:
    choices = typing.get_args(action)
    if value not in choices:
        raise ConfigError(option, f"got {value!r}; use one of {', '.join(choices)}")


def _integer(option: str, value: object, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ConfigError(option, f"got {value!r}; use an integer >= {low}")


def _json_able(option: str, value: object) -> None:
    if not isinstance(value, dict):
        raise ConfigError(option, f"got {type(value).__name__}; use a dict")
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            option, f"not JSON-able ({exc}); use plain numbers, strings, lists"
        ) from None


def _flag(option: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ConfigError(option, f"got {value!r}; use True or False")


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
        _choice("on_spike", self.action, SpikeAction)
        if not self.z > 0:
            raise ConfigError("spikes.z", f"got {self.z!r}; use a number > 0 (e.g. 6)")
        if not self.ratio >= 1:
            raise ConfigError("spikes.ratio", f"got {self.ratio!r}; use a number >= 1")
        if not 0 < self.beta < 1:
            raise ConfigError("spikes.beta", f"got {self.beta!r}; use 0 < beta < 1")
        _integer("spikes.warmup", self.warmup, 0)
        _integer("spikes.max_consecutive", self.max_consecutive, 1)


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

    def __post_init__(self) -> None:
        _choice("on_escalation", self.on_escalation, EscalationAction)
        _integer("checkpoint_every", self.checkpoint_every, 0)
        _integer("keep_checkpoints", self.keep_checkpoints, 1)
        _flag("resume", self.resume)
        for name in ("snapshot_every", "good_after", "skip_margin"):
            _integer(f"recovery.{name}", getattr(self, name), 0)
        for name in ("max_rollbacks", "lr_backoff_steps"):
            _integer(f"recovery.{name}", getattr(self, name), 1)
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
        _flag("inputs.check", self.check)
        check_ignore_inputs(self.ignore)
        self.ignore = tuple(self.ignore)
        _flag("inputs.allow_masks", self.allow_masks)


@dataclass
class HealthConfig:
    """Cross-rank health on the agreed numbers (docs/health.md); read by ``health/``.
    ``Guard(replica_check_every=, on_divergence=)`` set the first two."""

    replica_check_every: int = 100
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
        _integer("replica_check_every", self.replica_check_every, 0)
        _choice("on_divergence", self.on_divergence, DivergenceAction)
        _flag("health.detect_stragglers", self.detect_stragglers)
        _integer("health.straggler_warmup", self.straggler_warmup, 1)
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
        _integer("rerun.suspect_host_after", self.suspect_host_after, 0)


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
        _flag("hang.mark_saves", self.mark_saves)


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
        _integer("history.steps", self.steps, 1)
        if not self.metrics_lines_per_second > 0:
            raise ConfigError(
                "history.metrics_lines_per_second",
                f"got {self.metrics_lines_per_second!r}; use a number > 0 (math.inf: every step)",
            )


SECTIONS: dict[str, type] = {
    "spikes": SpikeConfig,
    "recovery": RecoveryConfig,
    "inputs": InputConfig,
    "health": HealthConfig,
    "rerun": RerunConfig,
    "hang": HangConfig,
    "history": HistoryConfig,
}
"""``GuardConfig``'s sections, by field name."""

KEYWORDS: dict[str, tuple[str, str]] = {
    "on_spike": ("spikes", "action"),
    "on_escalation": ("recovery", "on_escalation"),
    "checkpoint_every": ("recovery", "checkpoint_every"),
    "keep_checkpoints": ("recovery", "keep_checkpoints"),
    "resume": ("recovery", "resume"),
    "replica_check_every": ("health", "replica_check_every"),
    "on_divergence": ("health", "on_divergence"),
    "hang_timeout": ("hang", "timeout"),
}
"""The section options that are ``Guard`` keywords too, and where they live."""


@dataclass(init=False)
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
    accumulation_steps: int = 1
    """Micro-batches per optimizer step; ``watch()`` groups batches by this count."""
    min_loss_scale: float = 1.0
    """With a GradScaler: an overflow while the loss scale is below this escalates."""
    restore_buffers: bool = True
    """Put back the module buffers a step's forward wrote (BatchNorm statistics, counters)
    whenever the step is not applied, so a skipped step leaves the model as if its batch
    never came (``step/buffers.py``)."""
    run: str | None = None
    """Which run of ``run_dir`` this guard writes (every event carries its id). None: a new
    run, unless torchrun restarts the job or ``resume`` is set, which continue the latest;
    ``"new"``, ``"continue"`` (the latest run), or a run id to continue."""
    extra: dict[str, object] = field(default_factory=dict)
    """Free-form metadata written into the ``start`` event (experiment name, git sha...)."""
    factory_config: dict[str, object] = field(default_factory=dict)
    """What a replay factory needs to build the model (its arguments, a small JSON-able
    config): written into every bundle and passed to a ``--factory`` that takes an argument
    (``def make_replay(config): ...``), so nothing is smuggled in through the environment."""
    spikes: SpikeConfig = field(default_factory=SpikeConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    inputs: InputConfig = field(default_factory=InputConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    rerun: RerunConfig = field(default_factory=RerunConfig)
    hang: HangConfig = field(default_factory=HangConfig)
    history: HistoryConfig = field(default_factory=HistoryConfig)

    def __init__(
        self,
        run_dir: Path | str = "runs/trainguard",
        on_nonfinite: NonFiniteAction = "skip",
        max_consecutive: int = 5,
        capture: bool = True,
        grad_clip: float | None = None,
        accumulation_steps: int = 1,
        min_loss_scale: float = 1.0,
        restore_buffers: bool = True,
        run: str | None = None,
        extra: dict[str, object] | None = None,
        factory_config: dict[str, object] | None = None,
        spikes: SpikeConfig | None = None,
        recovery: RecoveryConfig | None = None,
        inputs: InputConfig | None = None,
        health: HealthConfig | None = None,
        rerun: RerunConfig | None = None,
        hang: HangConfig | None = None,
        history: HistoryConfig | None = None,
        *,
        on_spike: SpikeAction | None = None,
        on_escalation: EscalationAction | None = None,
        checkpoint_every: int | None = None,
        keep_checkpoints: int | None = None,
        resume: bool | None = None,
        replica_check_every: int | None = None,
        on_divergence: DivergenceAction | None = None,
        hang_timeout: float | None = None,
    ) -> None:
        """The core fields, the sections (None: their defaults) and, by keyword, the
        ``Guard`` keywords that live in a section (``KEYWORDS``: ``on_spike`` is
        ``spikes.action``...; None leaves the section's value)."""
        self.run_dir = run_dir
        self.on_nonfinite = on_nonfinite
        self.max_consecutive = max_consecutive
        self.capture = capture
        self.grad_clip = grad_clip
        self.accumulation_steps = accumulation_steps
        self.min_loss_scale = min_loss_scale
        self.restore_buffers = restore_buffers
        self.run = run
        self.extra = dict(extra) if extra is not None else {}
        self.factory_config = dict(factory_config) if factory_config is not None else {}
        self.spikes = spikes if spikes is not None else SpikeConfig()
        self.recovery = recovery if recovery is not None else RecoveryConfig()
        self.inputs = inputs if inputs is not None else InputConfig()
        self.health = health if health is not None else HealthConfig()
        self.rerun = rerun if rerun is not None else RerunConfig()
        self.hang = hang if hang is not None else HangConfig()
        self.history = history if history is not None else HistoryConfig()
        keywords = {
            "on_spike": on_spike,
            "on_escalation": on_escalation,
            "checkpoint_every": checkpoint_every,
            "keep_checkpoints": keep_checkpoints,
            "resume": resume,
            "replica_check_every": replica_check_every,
            "on_divergence": on_divergence,
            "hang_timeout": hang_timeout,
        }
        self._check_sections()
        self._take_keywords({k: v for k, v in keywords.items() if v is not None})
        self._check()

    def _check(self) -> None:
        self.run_dir = Path(self.run_dir)
        _choice("on_nonfinite", self.on_nonfinite, NonFiniteAction)
        _integer("max_consecutive", self.max_consecutive, 1)
        _flag("capture", self.capture)
        if self.grad_clip == 0 and not isinstance(self.grad_clip, bool):
            self.grad_clip = None  # the loops' own "off"
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise ConfigError(
                "grad_clip", f"got {self.grad_clip!r}; use a positive number, or None or 0 (off)"
            )
        _integer("accumulation_steps", self.accumulation_steps, 1)
        if not self.min_loss_scale > 0:
            raise ConfigError("min_loss_scale", f"got {self.min_loss_scale!r}; use a number > 0")
        _flag("restore_buffers", self.restore_buffers)
        _json_able("factory_config", self.factory_config)
        try:
            check_run_option(self.run)
        except ValueError as exc:
            raise ConfigError("run", str(exc)) from None

    def _check_sections(self) -> None:
        for name, kind in SECTIONS.items():
            if not isinstance(getattr(self, name), kind):
                raise ConfigError(
                    name,
                    f"got {getattr(self, name)!r}; use a trainguard.{kind.__name__}(...) "
                    f"or set its options by name ({name}.OPTION=...)",
                )

    @classmethod
    def from_options(cls, options: Mapping[str, object], text: bool = False) -> GuardConfig:
        """A config from options by name: ``Guard`` keywords, core fields, ``section.field``
        (``{"spikes.warmup": 20, "on_spike": "skip"}``: from a YAML file, argparse...), or
        whole sections; ``text``: the values are strings as typed on a command line. The
        same path ``Guard``'s keywords, ``trainguard run --option`` and the integrations
        take (an unknown name is a ``ConfigError`` naming the closest one)."""
        return options_config(options, text=text)

    def _take_keywords(self, given: dict[str, object]) -> None:
        """The ``Guard`` keywords given to the constructor, into their sections."""
        per_section: dict[str, dict[str, object]] = {}
        for name, value in given.items():
            section, key = KEYWORDS[name]
            per_section.setdefault(section, {})[key] = value
        for section, values in per_section.items():
            current: Any = getattr(self, section)
            replaced: Any = dataclasses.replace(current, **values)
            setattr(self, section, replaced)

    def start_fields(self) -> dict[str, object]:
        """What the ``start`` event records of the options (and ``extra``)."""
        return {
            "on_nonfinite": self.on_nonfinite,
            "max_consecutive": self.max_consecutive,
            "grad_clip": self.grad_clip,
            "accumulation_steps": self.accumulation_steps,
            **self.extra,
        }


def _keyword_property(name: str) -> property:
    section, key = KEYWORDS[name]

    def get(self: GuardConfig) -> Any:
        return getattr(getattr(self, section), key)

    def set_(self: GuardConfig, value: Any) -> None:
        setattr(getattr(self, section), key, value)

    return property(get, set_, doc=f"``{section}.{key}`` (a ``Guard`` keyword).")


for _name in KEYWORDS:  # read and set where they live (the constructor took them: InitVar)
    setattr(GuardConfig, _name, _keyword_property(_name))

CORE = tuple(f.name for f in dataclasses.fields(GuardConfig) if f.name not in SECTIONS)
"""``GuardConfig``'s own fields (not sections)."""


def flat_options(config: GuardConfig) -> dict[str, Any]:
    """Every option of ``config`` by its name: core fields, then ``section.field``."""
    values: dict[str, Any] = {name: getattr(config, name) for name in CORE}
    for name in SECTIONS:
        section = getattr(config, name)
        for option in dataclasses.fields(section):
            values[f"{name}.{option.name}"] = getattr(section, option.name)
    return values


def option_names() -> list[str]:
    """Every name ``options_config`` takes: core fields, keywords, ``section.field``."""
    dotted = [
        f"{name}.{f.name}" for name, kind in SECTIONS.items() for f in dataclasses.fields(kind)
    ]
    return [*CORE, *KEYWORDS, *SECTIONS, *dotted]


def options_config(
    options: Mapping[str, object], base: GuardConfig | None = None, text: bool = False
) -> GuardConfig:
    """A validated ``GuardConfig`` from options by name (the module docstring), on top of
    ``base`` (default: the defaults). ``text``: the values are strings as typed on a command
    line (``"20"``, ``"none"``, ``"true"``), turned into each option's type."""
    core: dict[str, Any] = {}
    sections: dict[str, dict[str, object]] = {name: {} for name in SECTIONS}
    whole: dict[str, object] = {}
    for name, value in options.items():
        if name in KEYWORDS:
            section, key = KEYWORDS[name]
        elif name in SECTIONS:
            whole[name] = value
            continue
        elif name in CORE:
            core[name] = _parsed(GuardConfig, name, value, name) if text else value
            continue
        elif "." in name and name.split(".", 1)[0] in SECTIONS:
            section, key = name.split(".", 1)
            if key not in {f.name for f in dataclasses.fields(SECTIONS[section])}:
                _unknown(name)
        else:
            _unknown(name)
        kind = SECTIONS[section]
        sections[section][key] = _parsed(kind, key, value, name) if text else value
    base = base or GuardConfig()
    built: dict[str, Any] = {}
    for name in SECTIONS:
        current: Any = whole.get(name, getattr(base, name))
        if sections[name]:
            if not dataclasses.is_dataclass(current) or isinstance(current, type):
                raise ConfigError(name, f"got {current!r}; use a {SECTIONS[name].__name__}")
            current = dataclasses.replace(current, **sections[name])
        built[name] = current
    return dataclasses.replace(base, **core, **built)


RENAMED: dict[str, str] = {
    **{f"spike_{key}": f"spikes.{key}" for key in ("z", "ratio", "beta", "warmup")},
    "spike_max_consecutive": "spikes.max_consecutive",
    **{key: f"recovery.{key}" for key in ("snapshot_every", "good_after", "max_rollbacks")},
    **{key: f"recovery.{key}" for key in ("skip_margin", "lr_backoff", "lr_backoff_steps")},
    "check_inputs": "inputs.check",
    "ignore_inputs": "inputs.ignore",
    "allow_masks": "inputs.allow_masks",
    "detect_stragglers": "health.detect_stragglers",
    "straggler_warmup": "health.straggler_warmup",
    "straggler_slowdown": "health.straggler_slowdown",
    "suspect_host_after": "rerun.suspect_host_after",
    "mark_saves": "hang.mark_saves",
    "history_steps": "history.steps",
    "metrics_lines_per_second": "history.metrics_lines_per_second",
}
"""Options that were ``GuardConfig`` fields before the sections, and their names now."""

DROPPED: dict[str, str] = {
    "spike_grace": "the spike rule's LR grace is 50 steps",
    "zero_lr_steps": "the ladder's last rung runs 5 steps at LR 0",
    "loss_tolerance": "a loss_mismatch event is written past a relative difference of 0.5",
    "straggler_window": "a straggler is judged over 40 steps",
    "straggler_min_lost": "a straggler must cost the job 10 ms a step",
    "suspect_host_window": "transient faults are counted over 1,000 steps",
    "max_recorded_steps": "guard.state.nonfinite_steps keeps the last 100",
}
"""Options no user set, dropped (their values are fixed), and what they were."""


def _unknown(name: str) -> None:
    if name in RENAMED:
        raise ConfigError(name, f"this option is {RENAMED[name]} now (docs/options.md)")
    if name in DROPPED:
        raise ConfigError(name, f"no longer an option: {DROPPED[name]}")
    close = difflib.get_close_matches(name, option_names(), n=1)
    hint = f"did you mean {close[0]}? " if close else ""
    raise ConfigError(
        name,
        f"no such option; {hint}the options are GuardConfig's fields and its sections' "
        "(section.option, e.g. spikes.warmup): docs/options.md",
    )


def _parsed(kind: type, key: str, value: object, option: str) -> object:
    """A command line's ``value`` for option ``key`` of dataclass ``kind``, as its type."""
    if not isinstance(value, str):
        return value
    hint = typing.get_type_hints(kind)[key]
    text = value.strip()
    allowed = set(_leaves(hint))
    if type(None) in allowed and text.lower() in ("none", "null", ""):
        return None
    if bool in allowed:
        if text.lower() in ("true", "yes", "on", "1"):
            return True
        if text.lower() in ("false", "no", "off", "0"):
            return False
    for number in (int, float):
        if number in allowed:
            try:
                return number(text) if number is int else _float(text)
            except ValueError:
                pass
    if tuple in allowed:
        return tuple(part for part in text.split(",") if part)
    if dict in allowed:
        try:
            return json.loads(text)
        except ValueError:
            raise ConfigError(option, f"got {value!r}; use a JSON object") from None
    if str in allowed or Path in allowed:
        return text
    words = {int: "an integer", float: "a number", bool: "true or false", type(None): "none"}
    wanted = " or ".join(words.get(kind, getattr(kind, "__name__", str(kind))) for kind in allowed)  # type: ignore[call-overload]
    raise ConfigError(option, f"got {value!r}; use {wanted}")


def _float(text: str) -> float:
    number = float(text)
    if math.isnan(number):
        raise ValueError(text)
    return number


def _leaves(hint: object) -> list[object]:
    origin = typing.get_origin(hint)
    if origin is None:
        return [hint]
    if origin is Literal:
        return [str]
    if origin in (typing.Union, types.UnionType):
        return [leaf for arg in typing.get_args(hint) for leaf in _leaves(arg)]
    return [origin]


def check_ignore_inputs(names: object) -> None:
    """``inputs.ignore`` must be a tuple (or list) of non-empty names."""
    if isinstance(names, str):
        raise ConfigError(
            "inputs.ignore",
            f"got the string {names!r}; use a tuple of names: inputs.ignore=({names!r},)",
        )
    if not isinstance(names, tuple | list) or not all(
        isinstance(name, str) and name for name in names
    ):
        raise ConfigError(
            "inputs.ignore",
            f"got {names!r}; use a tuple of batch keys or paths, e.g. ('attention_mask',)",
        )


def config_of(
    config: GuardConfig | None, options: dict[str, object], defaults: dict[str, object]
) -> GuardConfig:
    """``Guard``'s configuration: ``config`` when given, else one built from the keyword
    ``options`` (``options_config``). Keywords changed from their ``defaults`` beside
    ``config`` are refused, not dropped (which one would win is a guess)."""
    if config is None:  # a keyword left at its default does not undo a section's value
        changed = {k: v for k, v in options.items() if k not in defaults or v != defaults[k]}
        return options_config(changed)
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
