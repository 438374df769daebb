"""The options of ``trainguard run`` and how they reach the job's processes.

The command line turns into a :class:`RunOptions`; ``to_env`` writes it as JSON into the
``TRAINGUARD_RUN`` variable, which torchrun (and any launcher) passes to its workers with
the rest of the environment; ``from_env`` reads it back in each process. The bootstrap
folder (``bootstrap/sitecustomize.py``) goes first on ``PYTHONPATH``, before what the user
had there.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from trainguard.config import (
    KEYWORDS,
    GuardConfig,
    NonFiniteAction,
    flat_options,
    options_config,
)
from trainguard.distributed.elastic import SHARE_OFF_VAR
from trainguard.errors import ConfigError

ENV_VAR = "TRAINGUARD_RUN"
"""The options as JSON; set by ``trainguard run``, read by the bootstrap in every process."""

BOOTSTRAP_DIR = Path(__file__).resolve().parent / "bootstrap"
"""The folder holding the ``sitecustomize.py`` that attaches the guard."""

Launcher = Literal["torchrun", "plain"]

_TORCHRUN_MODULES = ("torch.distributed.run", "torch.distributed.launch")


@dataclass(frozen=True)
class RunOptions:
    """What ``trainguard run`` passes to the guard it attaches (``Guard``'s options)."""

    run_dir: str = "runs/trainguard"
    on_nonfinite: NonFiniteAction = "skip"
    hang_timeout: float | None = None
    capture: bool = True
    check_inputs: bool = True
    ignore_inputs: tuple[str, ...] = ()
    """``GuardConfig.ignore_inputs``: entries of the model call's inputs (``prestart.batch_of``)
    the input check leaves out, e.g. ``"[1]"`` for the second positional argument."""
    allow_masks: bool = True
    """``GuardConfig.allow_masks``: an input holding only 0 and -inf at a finite step is taken
    for an additive mask (``--no-allow-masks``: a bad step, as any non-finite input)."""
    launcher: Launcher = "plain"
    """``torchrun``: the command launches workers; its own process (the agent) never attaches."""
    options: dict[str, Any] = field(default_factory=dict)
    """Any other ``Guard`` option by name (``trainguard run --option NAME=VALUE``: a keyword
    such as ``replica_check_every``, a core field, or ``section.field``), values parsed."""

    def __post_init__(self) -> None:
        if isinstance(self.ignore_inputs, list):  # JSON: a list
            object.__setattr__(self, "ignore_inputs", tuple(self.ignore_inputs))
        self.guard_config()  # every option checked here, before the command starts

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    def guard_config(
        self, run: str | None = None, extra: dict[str, object] | None = None
    ) -> GuardConfig:
        """The attached guard's configuration: these options (``launcher`` is the run's own),
        the run it writes (None: as ``GuardConfig.run``) and its start event's ``extra``."""
        named = {
            "run_dir": self.run_dir,
            "on_nonfinite": self.on_nonfinite,
            "hang_timeout": self.hang_timeout,
            "capture": self.capture,
            "inputs.check": self.check_inputs,
            "inputs.ignore": self.ignore_inputs,
            "inputs.allow_masks": self.allow_masks,
        }
        config = options_config({**named, **self.options})
        return dataclasses.replace(config, run=run, extra={**config.extra, **(extra or {})})

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> RunOptions:
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        return cls(**known)


def launcher_of(command: Sequence[str]) -> Launcher:
    """``torchrun`` when ``command`` starts torchrun (``torchrun ...``, ``python -m
    torch.distributed.run ...``, the older ``torch.distributed.launch``), else ``plain``."""
    if not command:
        return "plain"
    if os.path.basename(command[0]) in ("torchrun", "torch.distributed.run"):
        return "torchrun"
    for i, word in enumerate(command[1:-1], start=1):  # the interpreter's own options
        if word == "-m":
            return "torchrun" if command[i + 1] in _TORCHRUN_MODULES else "plain"
        if not word.startswith("-"):
            break  # the script: what follows is its arguments
    return "plain"


def child_env(options: RunOptions, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment the command runs in: ``base`` (default: ours), the options in
    ``TRAINGUARD_RUN`` and the bootstrap folder first on ``PYTHONPATH``; unless set already,
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: torchrun then gives each restart a store of its
    own, where a restart through the store it shares across attempts (torch >= 2.5) can read
    the dead attempt's addresses and hang in the script's own ``init_process_group``
    (``distributed/elastic.py``; PyTorch's DDP tutorial ``multigpu_torchrun.py`` with a
    rank killed, under ``trainguard run``: 2 restarts of 2 hung there for good)."""
    env = dict(os.environ if base is None else base)
    env[ENV_VAR] = options.to_json()
    env.setdefault(SHARE_OFF_VAR, "1")
    path = env.get("PYTHONPATH", "")
    parts = [str(BOOTSTRAP_DIR), *(p for p in path.split(os.pathsep) if p)]
    env["PYTHONPATH"] = os.pathsep.join(parts)
    return env


def from_env(raw: str | None) -> RunOptions | None:
    """The options in ``TRAINGUARD_RUN`` (None when unset or not valid)."""
    if not raw:
        return None
    try:
        return RunOptions.from_mapping(json.loads(raw))
    except (ValueError, TypeError, ConfigError):
        return None


def describe_command(command: Sequence[str]) -> str:
    return shlex.join(command)


def named_options(pairs: list[str]) -> dict[str, object]:
    """``--option NAME=VALUE`` pairs, each value parsed as its option's type (ConfigError
    naming the option, or ``--option`` for a pair without ``=``)."""
    texts: dict[str, str] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name.strip():
            raise ConfigError("--option", f"got {pair!r}; use NAME=VALUE, e.g. spikes.warmup=20")
        texts[name.strip()] = value
    parsed = options_config(texts, text=True)
    if parsed.recovery.enabled:
        _refuse_recovery(texts)
    values = flat_options(parsed)
    return {name: _plain(values[_where(name)]) for name in texts}


def _refuse_recovery(texts: dict[str, str]) -> None:
    """ConfigError naming the ``--option`` that turns recovery on (``RecoveryConfig.enabled``:
    resume, checkpoints, rollback), which ``trainguard run`` cannot give: its snapshots,
    checkpoints and states at a failure are taken at ``guard.watch()``'s step boundary,
    which the script's own loop never reaches. Said before the job starts, not found out
    from a run that silently took none."""
    name = next((n for n in texts if _turns_on_recovery(n, texts[n])), next(iter(texts)))
    raise ConfigError(
        f"--option {name}",
        "trainguard run cannot give it: snapshots, checkpoints and states at a failure "
        "are taken at guard.watch()'s step boundary, and the script iterates its own "
        "loader; add the guard to the loop for recovery (docs/recovery.md)",
    )


def _turns_on_recovery(name: str, text: str) -> bool:
    """Whether ``--option name=text`` alone turns recovery on (False when it is not an
    option on its own: the pairs together were valid, one alone may not be)."""
    try:
        return options_config({name: text}, text=True).recovery.enabled
    except ConfigError:
        return False


def _where(name: str) -> str:
    """The ``flat_options`` name of a name ``options_config`` takes (a keyword's section)."""
    if name in KEYWORDS:
        section, key = KEYWORDS[name]
        return f"{section}.{key}"
    return name


def _plain(value: object) -> object:
    """A parsed option as JSON carries it to the job's processes (``TRAINGUARD_RUN``)."""
    return list(value) if isinstance(value, tuple) else value
