"""The rules that decide a step see agreed data only (issue 52): checked on their types.

Every rank must take the same decision, so a rule may read only what every rank agreed on
(the step's ``Agreement``: per-rank columns that the step's all-reduce made the same on
every rank) and the guard's replicated options and counters. A rule that is handed an
optimizer, a model, a scaler, a process group, a rank or a clock could read a rank's own
state, which differs exactly when something is wrong: here that is refused by the types.
"""

from __future__ import annotations

import dataclasses
import inspect
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from trainguard.config import GuardConfig
from trainguard.health.learning_rates import LrAgreement
from trainguard.health.replicas import ReplicaWatch, majority
from trainguard.health.stragglers import StragglerWatch
from trainguard.recovery.ladder import rung_for
from trainguard.step import policy
from trainguard.step.pipeline import StepPipeline
from trainguard.step.spikes import DeviceSpikeDetector, SpikeDetector
from trainguard.step.spikewatch import SpikeWatch
from trainguard.step.transient import origin_ranks
from trainguard.step.types import Agreement

RULES: list[Callable[..., Any]] = [
    policy.decide,
    SpikeWatch.judge,
    SpikeWatch.read,
    StepPipeline.decide,
    SpikeDetector.observe,
    DeviceSpikeDetector.observe,
    StragglerWatch.observe,
    ReplicaWatch.observe,
    LrAgreement.observe,
    majority,
    origin_ranks,
    rung_for,
]
"""The decisions' rules: the pipeline's decide stage, non-finite steps, spikes (host and
device), stragglers, replicas, learning rates, a rerun's origin, the rollback ladder."""

PLAIN = (int, float, bool, str, type(None), torch.Tensor, Agreement, GuardConfig)
"""What a rule may be handed: numbers (agreed ones; a device rule's agreed tensors), the
agreement, the options."""
PER_RANK_NAMES = {"rank", "optimizer", "model", "scaler", "group", "process_group", "clock"}


def _leaves(hint: Any) -> list[Any]:
    """The classes a type hint is made of (``list[float] | None`` -> list, float, None)."""
    origin = typing.get_origin(hint)
    if origin is None:
        return [hint]
    if origin is typing.Literal:  # option values: names
        return [type(arg) for arg in typing.get_args(hint)]
    found = [] if origin in (typing.Union, types.UnionType) else [origin]
    for arg in typing.get_args(hint):
        if arg is Ellipsis:  # tuple[str, ...]
            continue
        found += _leaves(arg)
    return found


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.__qualname__)
def test_a_rule_is_handed_agreed_data_only(rule: Callable[..., Any]) -> None:
    hints = typing.get_type_hints(rule)
    for name in inspect.signature(rule).parameters:
        if name == "self":
            continue
        assert name not in PER_RANK_NAMES, f"{rule.__qualname__} takes {name}"
        for leaf in _leaves(hints[name]):
            if leaf in (list, tuple, dict):
                continue
            assert leaf in PLAIN, f"{rule.__qualname__}({name}: {leaf})"


def test_the_agreement_and_the_options_hold_plain_values() -> None:
    """What the rules read holds no object of a rank's: lists of numbers, numbers, names
    (the options' sections alike)."""
    records: list[type] = [Agreement, GuardConfig]
    while records:
        record = records.pop()
        hints = typing.get_type_hints(record)
        for field in dataclasses.fields(record):
            for leaf in _leaves(hints[field.name]):
                if dataclasses.is_dataclass(leaf) and record is GuardConfig:
                    records.append(leaf)  # a section
                    continue
                allowed = (list, tuple, dict, int, float, bool, str, Path, object, type(None))
                assert leaf in allowed, (record, field.name, leaf)
                if leaf is object:  # the start event's metadata; the replay factory's config
                    assert field.name in ("extra", "factory_config")
        names = {field.name for field in dataclasses.fields(record)}
        assert not names & PER_RANK_NAMES, record


def test_the_agreement_carries_what_the_rules_need_of_each_rank() -> None:
    """A rank's learning rate and loss scale reach the rules agreed: as every rank's value,
    read the same way on every rank."""
    agreement = Agreement(
        loss_ranks=[],
        grad_ranks=[],
        exhausted_ranks=[],
        batches=[3, 3, 3],
        losses=[1.0, 1.0, 1.0],
        global_grad_norm=1.0,
        lrs=[1e-3, 5e-2, 1e-3],
        loss_scales=[1024.0, 512.0, 1024.0],
    )
    assert agreement.lr == 1e-3 and agreement.lrs_differ  # a jump on one rank is no grace
    assert agreement.loss_scale == 512.0  # a collapse on any rank counts
    agreement.lrs = [1e-3, 0.0, 1e-3]  # one rank's LR is not a host number
    assert agreement.lr is None and agreement.lrs_differ
    agreement.lrs, agreement.loss_scales = [2e-3] * 3, [0.0] * 3
    assert agreement.lr == 2e-3 and not agreement.lrs_differ and agreement.loss_scale is None
