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

- ``guard_config`` ``GuardConfig``, its ``Guard`` keywords, and the options by name
- ``sections``     one dataclass per part that reads its options
- ``by_name``      a value typed as text into its option's type; an unknown name's error
- ``checks``       the validation every option shares (each error names its option)

Offers: ``GuardConfig`` and its sections, ``options_config``, ``flat_options``,
``option_names``, ``config_of``, ``KEYWORDS``, ``SECTIONS``, ``CORE``, ``RENAMED``,
``DROPPED``, and the action types. A base module: it imports only ``errors`` and ``runs``.
"""

from trainguard.config.by_name import DROPPED, RENAMED
from trainguard.config.guard_config import (
    CORE,
    KEYWORDS,
    SECTIONS,
    GuardConfig,
    config_of,
    flat_options,
    option_names,
    options_config,
)
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

__all__ = [
    "CORE",
    "DROPPED",
    "KEYWORDS",
    "RENAMED",
    "SECTIONS",
    "DivergenceAction",
    "EscalationAction",
    "GuardConfig",
    "HangConfig",
    "HealthConfig",
    "HistoryConfig",
    "InputConfig",
    "NonFiniteAction",
    "RecoveryConfig",
    "RerunConfig",
    "SpikeAction",
    "SpikeConfig",
    "config_of",
    "flat_options",
    "option_names",
    "options_config",
]
