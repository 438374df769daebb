"""Plain-text views of ``inspect`` summaries and ``replay`` reports (the CLI prints them)."""

from __future__ import annotations

from typing import Any


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "kB", "MB"):
        if value < 1000:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.1f} GB"


def _num(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def _loss(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def _indices(indices: list[int] | None) -> str:
    if not indices:
        return "not recorded"
    if indices == list(range(indices[0], indices[0] + len(indices))):
        return f"{indices[0]}..{indices[-1]}"
    shown = ", ".join(map(str, indices[:8]))
    return shown + (", ..." if len(indices) > 8 else "")


def _what_happened(summary: dict[str, Any]) -> str:
    if summary["trigger"] == "spike":  # finite: the spike rule judged the agreed values
        losses = summary.get("losses") or []
        loss = f"mean loss {sum(losses) / len(losses):.6g}, " if losses else ""
        norm = summary.get("grad_norm")
        norm_text = f"gradient norm {norm:.6g}" if isinstance(norm, (int, float)) else ""
        return f"loss or gradient-norm spike ({loss}{norm_text}; every value finite)"
    return (
        f"non-finite {summary['trigger']} on ranks {summary['ranks']} "
        f"(loss on {summary['loss_ranks']}, gradients on {summary['grad_ranks']})"
    )


def inspect_text(summary: dict[str, Any]) -> str:
    lines = [
        f"bundle    {summary['bundle']}  ({summary['format']}, {_size(summary['bytes'])}, "
        f"{summary['world_size']} rank{'s' if summary['world_size'] != 1 else ''}"
        f"{', FSDP2 shards' if summary['sharded'] else ''})",
        f"step {summary['step']}: {_what_happened(summary)}; "
        f"decision {summary['decision']} ({summary['reason']}), {summary['time_utc']}",
        f"versions  torch {summary['torch']}, python {summary['python']}",
    ]
    same = summary.get("weights_identical_across_ranks")
    if same is not None:
        lines.append(
            f"weights   identical across ranks: {'yes' if same else 'NO (ranks diverged)'}"
        )
    lines.extend(_history_text(summary.get("history")))
    for rank in summary["per_rank"]:
        lines.append("")
        lines.extend(_rank_text(rank))
    return "\n".join(lines)


def _losses(values: Any) -> str:
    """A step's losses; none recorded (``trainguard run``'s gradient-only checks): "not seen"."""
    if not isinstance(values, list):
        return "not seen" if values is None else str(values)
    return "/".join(_num(v) for v in values) if values else "not seen"


def _history_text(history: dict[str, Any] | None) -> list[str]:
    if history is None:
        return ["history   not captured"]
    decisions = ", ".join(f"{k} {v}" for k, v in history["decisions"].items())
    lines = [
        f"history   {history['steps']} steps ({history['first_step']}..{history['last_step']}): "
        f"{decisions}; step {history['first_step']}: loss {_losses(history['first']['losses'])}"
        f", grad norm {_num(history['first']['grad_norm'])}"
    ]
    for record in history["last_records"]:
        lrs = record.get("lrs")
        lr = "/".join(_num(v) for v in lrs) if isinstance(lrs, list) and len(lrs) > 1 else None
        lines.append(
            f"  step {record.get('step')}: loss {_losses(record.get('losses'))}, grad norm "
            f"{_num(record.get('grad_norm'))}, {record.get('decision')}, "
            + (f"lrs {lr}" if lr else f"lr {_num(record.get('lr'))}")
        )
    return lines


def _rank_text(rank: dict[str, Any]) -> list[str]:
    mark = "  <- non-finite here" if rank["saw_it"] else ""
    micro = rank.get("micro_losses") or []
    losses = f" (micro-batches: {', '.join(_num(v) for v in micro)})" if len(micro) > 1 else ""
    lines = [
        f"rank {rank['rank']}{mark}",
        f"  host {rank['host']}, device {rank['device']}, "
        f"loss {'not seen' if rank['loss'] is None else _num(rank['loss'])}{losses}, "
        f"local grad norm {_num(rank['local_grad_norm'])}",
    ]
    bad = rank["nonfinite_params"]
    more = rank["nonfinite_params_total"] - len(bad)
    shown = ", ".join(bad) + (f" and {more} more" if more > 0 else "")
    lines.append(f"  non-finite gradients: {shown or 'none'}")
    indices = rank.get("dataset_indices") or []
    for i, batch in enumerate(rank.get("batch") or []):
        label = f"micro-batch {i}" if len(rank["batch"]) > 1 else "batch"
        idx = indices[i] if i < len(indices) else None
        lines.append(
            f"  {label}: {batch['type']}, {batch['batch_size']} samples, dataset indices "
            f"{_indices(idx)}"
        )
        lines.extend(f"    {_leaf_text(leaf)}" for leaf in batch["leaves"])
    if rank.get("batch") is None:
        lines.append("  batch: not stored (the loop did not use guard.watch)")
    files = ", ".join(f"{name} {_size(size)}" for name, size in sorted(rank["files"].items()))
    lines.append(f"  files: {files}")
    return lines


def _leaf_text(leaf: dict[str, Any]) -> str:
    if leaf["kind"] != "tensor":
        value = leaf.get("value", leaf.get("repr"))
        return f"{leaf['path']:<24} {leaf['kind']} {value!r}"
    shape = "[" + ", ".join(map(str, leaf["shape"])) + "]"
    stats = [f"{leaf['layout']}, {leaf['stored']} stored"] if "layout" in leaf else []
    if "nan" in leaf:
        bad = leaf["nan"] + leaf["inf"]
        stats.append(
            f"non-finite {bad} (nan {leaf['nan']}, inf {leaf['inf']})" if bad else "finite"
        )
    if "min" in leaf:
        stats.append(f"min {_num(leaf['min'])} max {_num(leaf['max'])}")
    return f"{leaf['path']:<24} {leaf['dtype']:<9} {shape:<14} {'  '.join(stats)}"


def replay_text(report: dict[str, Any]) -> str:
    def yes(value: bool) -> str:
        return "yes" if value else "no"

    runs = _runs_text(report)
    shown = _culprits_text(report)
    module = report["module"] or ("- (outside any module)" if report["op"] else "-")
    op = report["op"] or "-"
    if report.get("op_detail") and report["op"]:
        op += f"   {report['op_detail']}"
    backward = report.get("backward")
    if report.get("bundle"):
        head = (
            f"replay    {report.get('bundle')} (step {report.get('step')}, rank "
            f"{report.get('rank')} of {report.get('world_size')}, on {report.get('device')})"
        )
    else:
        head = f"diagnose  a live step (on {report.get('device')})"
    lines = [
        head,
        *_setup_lines(report),
        f"reproduced     {yes(report['reproduced'])} ({runs})",
        f"deterministic  {yes(report['deterministic'])}",
        f"phase          {report['phase'] or '-'}",
        f"op             {op}",
    ]
    if backward:
        lines.append(
            f"               in {backward['grad_fn']}, the gradient of {backward['forward_op']}"
        )
    lines += [
        f"module         {module}",
        f"source         {report['source'] or '-'}"
        + (f"   {report['code']}" if report.get("code") else ""),
    ]
    if report.get("nan_op"):
        lines.append(
            f"nan_op         {report['nan_op']}   {report.get('nan_op_detail') or ''}".rstrip()
        )
    lines += _evidence_lines(report)
    lines += [f"culprits       {shown}", f"verdict        {report['verdict']}"]
    lines += _path_lines(report.get("path") or [], report.get("roots") or [])
    lines += ["", report["summary"]]
    if report.get("advice"):
        lines += ["", f"advice: {report['advice']}"]
    return "\n".join(lines)


def _evidence_lines(report: dict[str, Any]) -> list[str]:
    """Where the gradient went non-finite (a forward value the loss never read), and what
    wrote non-finite weights (the update, its param group, its hyper-parameter)."""
    lines = []
    grad = report.get("gradient_op")
    if grad:
        lines.append(
            f"gradient       {grad['op']} ({grad['grad_fn']}, the gradient of "
            f"{grad['forward_op']}) made {grad['value']} gradients"
        )
    weights = report.get("weights") or {}
    rows = weights.get("rows")
    if rows and 0 < rows["count"] < rows["total"]:
        read = f", read by samples {weights['readers']}" if weights.get("readers") else ""
        lines.append(f"rows           {rows['text']}{read}")
    writer = weights.get("writer") or {}
    if writer.get("step") is not None and report["verdict"] != "nonfinite_rows":
        group = f", param group {writer['group']}" if writer.get("group") is not None else ""
        hypers = ", ".join(f"{h['name']} {h['value']}" for h in writer.get("hyperparameters", []))
        lines.append(
            f"written by     the update of step {writer['step']}{group}"
            + (f" ({hypers})" if hypers else "")
        )
    return lines


def _runs_text(report: dict[str, Any]) -> str:
    """What the ``reproduced`` line counts: the non-finite replays, or for a spike's bundle
    replayed finite the replays that gave the recorded loss again."""
    repeats = report.get("repeats", 0)
    if report["verdict"] == "spike" or (report["reproduced"] and "recorded_loss_runs" in report):
        return f"{repeats} replays gave the recorded loss"
    if "recorded_loss_runs" in report:
        loss = (report.get("recorded") or {}).get("loss")
        return (
            f"{report['recorded_loss_runs']}/{repeats} replays reached the recorded loss "
            f"{_num(loss)}"
        )
    return f"{report.get('nonfinite_runs', 0)}/{repeats} replays non-finite"


def _setup_lines(report: dict[str, Any]) -> list[str]:
    """How the bundle was replayed: the autocast, the ranks, the replicas."""
    lines = []
    autocast = report.get("autocast")
    if autocast:
        lines.append(f"autocast       {autocast['text']}")
        if report.get("float32_reproduced") is not None:
            again = "non-finite too" if report["float32_reproduced"] else "finite"
            lines.append(f"               in float32 (autocast off) the step is {again}")
    ranks = _ranks_text(report)
    if ranks:
        lines.append(f"ranks          {ranks}")
    for replay in report.get("rank_replays") or []:
        state = "non-finite" if replay["reproduced"] else "finite"
        lines.append(
            f"  rank {replay['rank']}: own replay {state} (loss {_losses(replay['losses'])}, "
            f"grad norm {_num(replay['grad_norm'])}) -> {replay['role']}"
        )
    replicas = report.get("replicas") or {}
    if replicas.get("checked"):
        mismatches = replicas.get("mismatches") or []
        if mismatches:
            names = ", ".join(m["name"] for m in mismatches[:3])
            more = f" and {len(mismatches) - 3} more" if len(mismatches) > 3 else ""
            lines.append(
                f"replicas       DIFFER: {names}{more} (ranks "
                f"{', '.join(map(str, replicas['disagreeing_ranks']))})"
            )
        else:
            lines.append(f"replicas       identical across ranks {replicas['ranks']}")
    return lines


def _ranks_text(report: dict[str, Any]) -> str:
    origin, received = report.get("origin_ranks"), report.get("received_ranks")
    if (report.get("world_size") or 1) < 2 or (not origin and not received):
        return ""
    if report.get("rank_replays"):
        how = "by replaying the ranks"
    else:
        recorded = {"loss": "losses", "input": "inputs"}.get(str(report.get("trigger")))
        how = f"by the recorded {recorded or 'gradients'}"
    parts = [f"made on {origin or 'none'}"]
    if received:
        parts.append(f"received through the all-reduce on {received}")
    if report.get("received_from"):
        parts.append(f"rank {report.get('rank')} received it from {report['received_from']}")
    elif report.get("bad_elsewhere"):
        parts.append(f"rank {report.get('rank')} was fine (bad on {report['bad_elsewhere']})")
    return "; ".join(parts) + f" ({how})"


def _path_lines(path: list[dict[str, Any]], roots: list[dict[str, Any]]) -> list[str]:
    from trainguard.replay.chain import hop_text

    lines = []
    if len(path) > 1:
        lines.append("path           (root first)")
        lines.extend(f"  {hop_text(hop)}" for hop in path)
    if len(roots) > 1:
        lines.append(f"roots          {len(roots)} independent roots")
        for root in roots:
            what = root.get("op") or root.get("label") or root.get("kind")
            where = root.get("module") or "-"
            lines.append(
                f"  {what:<22} {root.get('value', ''):<5} {where}  {root.get('source') or ''}"
            )
    return lines


def _culprits_text(report: dict[str, Any]) -> str:
    culprits = report["culprit_samples"]
    if culprits:
        shown = ", ".join(
            f"{c['position']}"
            + (f" (index {c['index']})" if c.get("index") is not None else "")
            + (f" in micro-batch {c['micro_batch']}" if c.get("micro_batch") else "")
            for c in culprits
        )
    elif report["verdict"] == "spike":
        shown = "not searched (a spike: every sample is finite)"
    elif report["reproduced"] and not report.get("bisected", True):
        whole = report.get("weights") or report.get("growth") or report.get("runaway")
        why = report.get("unsearched") or (
            "the cause is not a sample's" if whole else "no bisection"
        )
        shown = f"not searched ({why})"
    elif report.get("every_sample_bad"):
        shown = "none: every sample tried is bad on its own"
    else:
        shown = "none" if not report["reproduced"] else "none: no single sample is to blame"
    return shown


def demo_event_line(event: dict[str, Any], every: int = 5) -> str | None:
    """One progress line for a rank-0 event of the demo run, or None to stay quiet."""
    kind, step = event.get("kind"), event.get("step")
    if kind == "demo_progress":
        steps = int(event.get("steps", 0))
        if not event.get("ok") or (step is not None and (step + 1) % every and step + 1 != steps):
            return None
        done = (step or 0) + 1
        bar = "#" * (20 * done // max(steps, 1))
        return f"  step {done:>3}/{steps}  loss {_loss(event.get('loss'))}  [{bar:<20}]"
    if kind == "nonfinite":
        return (
            f"  step {step:>3}: non-finite {event.get('where')} on rank(s) {event.get('ranks')}"
            f" -> every rank {event.get('action')}s it"
        )
    if kind == "capture":
        return (
            f"  step {step:>3}: captured to {event.get('path')} "
            f"({_size(int(event.get('bytes', 0)))} in {event.get('seconds')} s)"
        )
    if kind == "capture_failed":
        return f"  step {step:>3}: capture failed: {event.get('error')}"
    return None


def demo_text(result: dict[str, Any]) -> str:
    """The end of the demo: what training did, then the replay's diagnosis."""
    report = result["report"]
    lines = [
        f"training done in {result['train_seconds']:.1f} s: {result['skipped']} step skipped, "
        f"final loss {_loss(result['final_loss'])}",
        "",
        f"trainguard replay {result['bundle']} --factory trainguard.demo:make_replay "
        f"({result['replay_seconds']:.1f} s):",
        "",
        replay_text(report),
    ]
    missing = result.get("missing_classes")
    if missing:
        lines += [
            "",
            f"(The demo knows its loss: element [k] of the per-class vector is class k, and "
            f"rank {report.get('rank')}'s batch has no sample of class "
            f"{', '.join(map(str, missing))}.)",
        ]
    return "\n".join(lines)
