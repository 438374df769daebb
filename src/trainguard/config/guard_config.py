"""``GuardConfig``: the core's own fields (what the step itself uses: the non-finite policy,
clipping, the run dir...) and a section per part; the ``Guard`` keywords that live in a
section (``KEYWORDS``); ``config_of``, which builds ``Guard``'s configuration."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainguard.config.by_name import parsed_value, unknown_option
from trainguard.config.checks import check_choice, check_flag, check_integer, check_json_able
from trainguard.config.sections import (
    DivergenceAction,
    EscalationAction,
    HangConfig,
    HealthConfig,
    HistoryConfig,
    InputConfig,
    NonFiniteAction,
    RecoveryConfig,
    RerunConfig,
    SpikeAction,
    SpikeConfig,
)
from trainguard.errors import ConfigError
from trainguard.runs.identity import check_run_option

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
        check_choice("on_nonfinite", self.on_nonfinite, NonFiniteAction)
        check_integer("max_consecutive", self.max_consecutive, 1)
        check_flag("capture", self.capture)
        if self.grad_clip == 0 and not isinstance(self.grad_clip, bool):
            self.grad_clip = None  # the loops' own "off"
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise ConfigError(
                "grad_clip", f"got {self.grad_clip!r}; use a positive number, or None or 0 (off)"
            )
        check_integer("accumulation_steps", self.accumulation_steps, 1)
        if not self.min_loss_scale > 0:
            raise ConfigError("min_loss_scale", f"got {self.min_loss_scale!r}; use a number > 0")
        check_flag("restore_buffers", self.restore_buffers)
        check_json_able("factory_config", self.factory_config)
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
            core[name] = parsed_value(GuardConfig, name, value, name) if text else value
            continue
        elif "." in name and name.split(".", 1)[0] in SECTIONS:
            section, key = name.split(".", 1)
            if key not in {f.name for f in dataclasses.fields(SECTIONS[section])}:
                unknown_option(name, option_names())
        else:
            unknown_option(name, option_names())
        kind = SECTIONS[section]
        sections[section][key] = parsed_value(kind, key, value, name) if text else value
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


def config_of(
    config: GuardConfig | None, options: dict[str, object], defaults: dict[str, object]
) -> GuardConfig:
    """``Guard``'s configuration: ``config`` when given, else one built from the keyword
    ``options`` (``options_config``). Keywords changed from their ``defaults`` beside
    ``config`` are refused, not dropped (which one would win is a guess). ``extra`` is
    refused as a keyword: ``Guard``'s ``extra_state`` is the loop's stateful objects,
    ``extra`` the start event's metadata, which goes in the ``GuardConfig``."""
    if "extra" in options:
        raise ConfigError(
            "extra",
            "pass it as config=GuardConfig(..., extra={...}) (the start event's metadata); "
            "extra_state= is for the loop's own stateful objects",
        )
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
