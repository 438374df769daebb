"""What a replay says beyond its diagnosis: which rank made the non-finite values, and why
a replay that stayed finite did.

- reproduced: the origin rank made it, and which ranks only received it (origin.py);
- finite on a ``--rank`` that received it from another rank, or was fine while another went
  bad: that, not "suspect its device";
- finite on a batch holding non-finite values that made the recorded step non-finite
  (verdict ``input_handled``): the factory's loss_fn handles them, no device is suspected;
- finite, and the rank's forward had got a non-finite input its fetched batch did not hold
  (verdict ``input_made_in_loop``): the loop's code, so no device is suspected;
- finite on a capture that lacks micro-batches the loop overwrote (it refilled one input
  buffer: ``step/manual.py``): the replay says nothing about the step, no device suspected;
- finite under another ``--autocast`` than the step ran under: that (autocast.py);
- finite with ``replay_spec``'s model loss, where the run's Trainer computed its own loss
  (``loss_source``): verdict ``loss_not_replayed``, no device suspected;
- finite on every rank: none of them made it in its own forward and backward;
- otherwise a transient fault, with how often the rank and its host went bad in the run's
  other captures (a fault that keeps hitting one GPU or node points at hardware).
"""

from __future__ import annotations

import json

from trainguard.capture.bundle import Bundle
from trainguard.replay import autocast as precision
from trainguard.replay import origin
from trainguard.replay.report import ReplayReport
from trainguard.replay.verdicts import (
    ADVICE,
    ELSEWHERE_ADVICE,
    OVERWRITTEN_ADVICE,
    RECEIVED_ADVICE,
)

MODEL_LOSS = "trainguard.integrations.transformers.model_loss"
"""``replay_spec``'s loss_fn: the model's own loss, not a Trainer's ``compute_loss``."""


def explain(
    report: ReplayReport,
    found: origin.RankOrigin,
    bundle: Bundle,
    run_rank: origin.RankRun,
    autocast: precision.Autocast,
) -> None:
    """Say which rank made the non-finite values; a rank that only received them, or a step
    replayed under another autocast than it ran, is not "not reproduced, suspect its
    device"."""
    if report.verdict == "spike" or bundle.trigger == "spike":  # finite: no rank made a NaN
        return
    if report.reproduced:
        sentence = origin.origin_sentence(found)
        report.summary += f" {sentence}" if sentence else ""
        return
    if report.verdict in ("bad_input", "input_mask", "nonfinite_hyperparameter"):
        return  # this rank's batch, or its optimizer's hyper-parameter: not the device
    if (
        bundle.world_size > 1
        and found.method == "option"
        and origin.went_bad_elsewhere(found, bundle, run_rank)
    ):
        losses = report.details.get("replayed", {}).get("losses") or []
        report.summary = origin.elsewhere_summary(found, losses[0] if losses else None)
        report.advice = RECEIVED_ADVICE if found.received else ELSEWHERE_ADVICE
        return
    if report.verdict in ("input_made_in_loop", "input_handled"):  # the loop's code, or
        return  # the factory's loss_fn handling the batch's values: not the device
    lost = bundle.meta(found.rank).get("overwritten_micro_batches")
    if lost:  # the capture lacks micro-batches the loop overwrote: nothing to conclude
        report.summary = overwritten_summary(lost)
        report.advice = OVERWRITTEN_ADVICE
        return
    if _loss_not_replayed(report, bundle, found.rank):
        return
    otherwise = precision.otherwise_summary(autocast)
    note = precision.unrecorded_note(autocast)
    if otherwise is not None:  # replayed under another autocast than the step ran under
        report.summary, report.advice = otherwise, precision.OTHERWISE_ADVICE
    elif found.method == "replay" and not found.origin_ranks:
        report.summary += origin.none_reproduces(found) + note
    else:
        report.summary += recurrence_note(bundle, found.rank) + note


def _loss_not_replayed(report: ReplayReport, bundle: Bundle, rank: int) -> bool:
    """A finite replay of a step whose loss the run's Trainer computed itself (``meta.json``'s
    ``loss_source``): with ``replay_spec``'s model loss, the replay did not compute that loss
    (True: verdict ``loss_not_replayed``); with another loss_fn, the summary names both
    (False)."""
    source = bundle.meta(rank).get("loss_source")
    if not source:
        return False
    used = str(report.details.get("loss_fn") or "the factory's loss_fn")
    if used != MODEL_LOSS:
        report.summary += f" (The run's loss came from {source}; the replay used {used}.)"
        return False
    report.summary = (
        f"Finite when replayed, but the run's loss came from {source} and the replay's from "
        f"{used} (the model's own loss): the replay did not compute the loss the run did, so "
        "it says nothing yet about a transient fault or a device."
    )
    report.verdict = "loss_not_replayed"
    report.advice = ADVICE["loss_not_replayed"]
    return True


def recurrence_note(bundle: Bundle, rank: int) -> str:
    """For a step that did not reproduce: how often this rank and its host went bad in the
    run's other captures (a fault that keeps hitting one GPU or node points at hardware)."""
    host = (bundle.meta(rank).get("env") or {}).get("host")
    captures = sorted(p for p in bundle.path.parent.glob("step-*") if p.is_dir())
    same_rank = 0
    for folder in captures:
        try:
            manifest = json.loads((folder / "manifest.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        same_rank += rank in manifest.get("ranks", [])
    where = f"rank {rank}" + (f" on host {host}" if host else "")
    if len(captures) > 1 and same_rank > 1:
        return (
            f" It went bad on {where} in {same_rank} of the run's {len(captures)} captures: "
            f"suspect that GPU or node (test it, or exclude {host or 'it'} and rerun)."
        )
    return f" It went bad on {where}: if it happens there again, suspect that GPU or node."


def overwritten_summary(lost: list[int]) -> str:
    """The summary of a finite replay whose capture lacks overwritten micro-batches."""
    return (
        f"The step did not reproduce, but this capture does not hold its micro-batch(es) {lost}: "
        "the loop copied every micro-batch into one input buffer, which overwrote them before "
        "the step ended (the guard keeps copies from the step after on); the replay ran on "
        "what the buffer held last, so a finite replay says nothing about the step's fault."
    )
