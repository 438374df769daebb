"""The ``trainguard`` command, a thin layer over the library.

Exit codes: 0 success, 1 a finding (e.g. a failed doctor check), 2 bad input, 141 the
reader of stdout went away (``| head``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from trainguard import __version__
from trainguard.errors import TrainGuardError
from trainguard.events import to_jsonable

EXIT_OK = 0
EXIT_FINDING = 1
EXIT_USAGE = 2
EXIT_PIPE_CLOSED = 141
"""Exit status when stdout's reader went away (``trainguard report RUN | head -1``): 128 +
SIGPIPE, what a shell reports for a tool a closed pipe ended (``yes | head``), so a script
under ``set -o pipefail`` can tell a cut-short listing from a complete one (0 would say the
output was complete; Python's own default, 1, reads as a failure of the command)."""
FINITE_FINDINGS = ("replica_mismatch", "nonfinite_hyperparameter")
"""Replay verdicts that are a finding (exit 1) although the step replays finite."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USAGE, f"trainguard: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="trainguard",
        description="Keep PyTorch training runs alive and debuggable.",
    )
    parser.add_argument("--version", action="version", version=f"trainguard {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    _add_capture_commands(commands)
    _add_doctor_command(commands)
    _add_report_command(commands)
    _add_run_command(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Callable[[argparse.Namespace], int] | None = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return EXIT_OK
    try:
        code = handler(args)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's last flush
        return code
    except BrokenPipeError:
        return _stdout_closed()
    except (TrainGuardError, OSError) as exc:
        print(f"trainguard: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


def _stdout_closed() -> int:
    """End quietly once the reader of stdout is gone, as Python's docs advise (the ``signal``
    module's "Note on SIGPIPE"): stdout is pointed at os.devnull, so that the interpreter's
    final flush of what is still buffered does not fail again and print a traceback."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout is no file (an embedding, a test's capture)
        pass
    return EXIT_PIPE_CLOSED


# -- capture, replay, demo --------------------------------------------------------------------


def _add_capture_commands(commands: Any) -> None:
    inspect = commands.add_parser("inspect", help="show what a capture bundle holds")
    inspect.add_argument("bundle", type=Path, help="a captures/step-NNNNNNNN folder")
    inspect.add_argument("--json", action="store_true", help="print one JSON object")
    inspect.set_defaults(handler=_inspect)
    replay = commands.add_parser(
        "replay",
        help="re-run a captured step and diagnose it (exit 1 when it reproduces)",
        description="Re-run a captured step: phase, op, module, line, culprit samples. Exit 0: "
        "the step did not reproduce; 1: it did, or the ranks' replicated weights differ (a "
        "finding); 2: bad input.",
    )
    replay.add_argument("bundle", type=Path, help="a captures/step-NNNNNNNN folder")
    replay.add_argument(
        "--factory",
        required=True,
        metavar="MODULE:FUNC",
        help="a function with no arguments returning (model, loss_fn) or trainguard.ReplaySpec",
    )
    replay.add_argument(
        "--rank",
        type=int,
        default=None,
        help="whose part (default: the rank where the non-finite values arose)",
    )
    replay.add_argument("--repeats", type=int, default=3, help="runs for the determinism check")
    replay.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1 ...")
    replay.add_argument(
        "--autocast",
        choices=("off", "float16", "bfloat16"),
        default=None,
        help="run forward and loss under this autocast dtype, or off (float32) (default: the "
        "autocast state the bundle recorded)",
    )
    replay.add_argument("--json", action="store_true", help="print one JSON object")
    replay.set_defaults(handler=_replay)
    demo = commands.add_parser(
        "demo", help="a real 2-rank run that hits 0/0, captured and replayed"
    )
    demo.add_argument("--ranks", type=int, default=2, help="worker processes, 1 to 32")
    demo.add_argument("--steps", type=int, default=30, help="training steps, 5 to 100000")
    demo.add_argument("--run-dir", type=Path, default=Path("runs/demo"))
    demo.set_defaults(handler=_demo)


def _print_json(data: dict[str, Any]) -> None:
    print(json.dumps(to_jsonable(data), allow_nan=False))


def _inspect(args: argparse.Namespace) -> int:
    from trainguard.capture.inspect import inspect_bundle
    from trainguard.replay.render import inspect_text

    summary = inspect_bundle(args.bundle)
    if args.json:
        _print_json(summary)
    else:
        print(inspect_text(summary))
    return EXIT_OK


def _replay(args: argparse.Namespace) -> int:
    from trainguard.replay.render import replay_text
    from trainguard.replay.runner import replay
    from trainguard.report.replays import save_replay_result

    with contextlib.redirect_stdout(sys.stderr):  # the user's prints must not mix with ours
        report = replay(
            args.bundle,
            args.factory,
            rank=args.rank,
            repeats=args.repeats,
            device=args.device,
            autocast=args.autocast,
        ).to_dict()
    if args.rank is None and args.autocast is None:  # the bundle's own diagnosis, not a
        save_replay_result(args.bundle, report)  # look at another rank or autocast: the report
    if args.json:
        _print_json(report)
    else:
        print(replay_text(report))
    finding = report["reproduced"] or report["verdict"] in FINITE_FINDINGS
    return EXIT_FINDING if finding else EXIT_OK


def _demo(args: argparse.Namespace) -> int:
    from trainguard.demo import DemoError, check_options, run_demo
    from trainguard.replay.render import demo_event_line, demo_text

    try:
        check_options(args.ranks, args.steps)  # before the banner: bad input is one line
    except TrainGuardError as exc:
        print(f"trainguard: demo: {exc}", file=sys.stderr)
        return EXIT_USAGE
    ranks = f"{args.ranks} rank{'s' if args.ranks != 1 else ''}"
    print(
        f"trainguard demo: {ranks} on CPU (gloo, DDP), launched with "
        f"torch.distributed.run; {args.steps} steps; run dir {args.run_dir}",
        flush=True,
    )

    def show(event: dict[str, Any]) -> None:
        line = demo_event_line(event)
        if line is not None:
            print(line, flush=True)

    try:
        result = run_demo(args.ranks, args.steps, args.run_dir, on_event=show)
    except DemoError as exc:
        print(f"trainguard: demo: {exc}", file=sys.stderr)
        return EXIT_FINDING
    print()
    print(demo_text(dataclasses.asdict(result)))
    return EXIT_OK


# -- report ----------------------------------------------------------------------------------


def _add_report_command(commands: Any) -> None:
    report = commands.add_parser(
        "report",
        help="a run at a glance: text summary and RUN_DIR/report.html",
        description="Summarize a run directory (events, metrics, captures, hangs), print it "
        "and write RUN_DIR/report.html. Exit 2 when there is nothing to report.",
    )
    report.add_argument("run_dir", type=Path, help="the Guard's run_dir")
    report.add_argument("--json", action="store_true", help="print one JSON object")
    report.add_argument("--png", type=Path, default=None, help="also write the timeline here")
    report.add_argument("--no-html", action="store_true", help="do not write report.html")
    report.add_argument(
        "--run",
        metavar="ID",
        default=None,
        help="the run to report (default: the latest in RUN_DIR; 'all': every run)",
    )
    report.add_argument(
        "--runs", action="store_true", help="list the runs in RUN_DIR (id, start, steps)"
    )
    report.set_defaults(handler=_report)


def _report(args: argparse.Namespace) -> int:
    from trainguard.report.command import run_report

    return run_report(
        args.run_dir,
        as_json=args.json,
        png=args.png,
        html=not args.no_html,
        run=args.run,
        list_runs=args.runs,
    )


# -- doctor ----------------------------------------------------------------------------------


def _add_doctor_command(commands: Any) -> None:
    doctor = commands.add_parser(
        "doctor",
        help="check this host and, under torchrun, every rank before a long job",
        description="Check the environment that distributed training needs (versions, GPUs, "
        "/dev/shm, open files, NCCL/gloo variables, MASTER_ADDR/MASTER_PORT, RANK/WORLD_SIZE). "
        "Under torchrun every rank runs it: ranks check in, compare versions and variables and "
        "run a collective smoke test. Exit 0: healthy; 1: a failure or warning; 2: bad usage.",
    )
    doctor.add_argument("--json", action="store_true", help="print one JSON object")
    doctor.add_argument(
        "--timeout",
        type=_positive_seconds,
        default=30.0,
        metavar="SECONDS",
        help="bound on each wait: name lookup (at most 10 s), store, check-in, collectives "
        "(default 30)",
    )
    doctor.add_argument(
        "--bandwidth-mb",
        type=_non_negative_mb,
        default=64.0,
        metavar="MB",
        help="size of the all_reduce whose bandwidth is measured; 0 skips it (default 64)",
    )
    doctor.set_defaults(handler=_doctor)


def _positive_seconds(text: str) -> float:
    value = _number(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"got {text}; use a number of seconds > 0")
    return value


def _non_negative_mb(text: str) -> float:
    value = _number(text)
    if not 0 <= value <= 16384:
        raise argparse.ArgumentTypeError(f"got {text}; use 0 (skip) to 16384 MB")
    return value


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"got {text!r}; use a number") from None


def _doctor(args: argparse.Namespace) -> int:
    from trainguard.doctor import DoctorOptions, report_text, run_doctor

    report = run_doctor(DoctorOptions(timeout_s=args.timeout, bandwidth_mb=args.bandwidth_mb))
    if args.json:
        _print_json(report.to_dict())
    else:
        print(report_text(report))
    sys.stdout.flush()
    report.close()  # under torchrun: wait until every rank has printed
    if report.hard_exit:  # a thread is stuck in a collective: it cannot be joined
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(report.exit_code)
    return report.exit_code


# -- run ---------------------------------------------------------------------------------------


def _add_run_command(commands: Any) -> None:
    run = commands.add_parser(
        "run",
        help="run an unmodified training script with the guard attached",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run COMMAND (python script.py, python -m module, torchrun ... script.py) "
        "with the guard attached from the outside: at the first optimizer step it finds the "
        "model and the process group, checks every step's gradients on every rank (a "
        "non-finite one skips the step on all ranks, buffers put back, a replay bundle "
        "written) and runs the hang watchdog (exit 91 hang, 92 peer failure). It cannot see "
        "the loss value, loss spikes or uneven data across ranks. It stands aside (one line, "
        "the script runs unguarded) when the model already has a trainguard guard, when a "
        "second optimizer steps, or when it cannot find the model. Exit status: the "
        "command's, or 91/92 when the guard ended the run. See docs/run.md.",
        epilog="environment passed to the job: TRAINGUARD_RUN (the options as JSON), "
        "PYTHONPATH (trainguard's bootstrap folder first)",
    )
    run.add_argument("--run-dir", default="runs/trainguard", help="events/, captures/, hangs/")
    run.add_argument(
        "--on-nonfinite",
        choices=("skip", "warn", "raise"),
        default="skip",
        help="skip the step on every rank (default), only log it, or raise in the script",
    )
    run.add_argument(
        "--hang-timeout",
        type=_non_negative_seconds,
        default=None,
        metavar="SECONDS",
        help="seconds without progress before a hang (default: learned; 0: no watchdog)",
    )
    run.add_argument(
        "--capture",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="write a replay bundle of the first bad step (default: on)",
    )
    run.add_argument(
        "--check-inputs",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="check the model call's floating-point inputs for NaN/Inf (default: on)",
    )
    run.add_argument(
        "--allow-masks",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="an input holding only 0 and -inf at a step whose gradients are finite is an "
        "additive mask: not skipped, left out of the check from then on (default: on)",
    )
    run.add_argument(
        "--ignore-inputs",
        action="append",
        default=[],
        metavar="NAME",
        help="an input the check leaves out (an additive -inf mask): a keyword argument's name "
        "or a path as the guard's messages print it, e.g. '[1]' for the second positional "
        "argument (repeatable)",
    )
    run.add_argument(
        "--option",
        "-o",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="any other Guard option by name: a keyword (replica_check_every=0), a field "
        "(max_consecutive=10) or section.option (spikes.warmup=20, health.detect_stragglers="
        "false); repeatable; the names: docs/guard.md",
    )
    run.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    run.set_defaults(handler=_run)


def _non_negative_seconds(text: str) -> float:
    value = _number(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"got {text}; use a number of seconds >= 0")
    return value


def _run(args: argparse.Namespace) -> int:
    from trainguard.attach.launch import run_command
    from trainguard.attach.options import RunOptions, named_options
    from trainguard.attach.status import unguarded_line

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    options = RunOptions(
        run_dir=args.run_dir,
        on_nonfinite=args.on_nonfinite,
        hang_timeout=args.hang_timeout,
        capture=args.capture,
        check_inputs=args.check_inputs,
        ignore_inputs=tuple(args.ignore_inputs),
        allow_masks=args.allow_masks,
        options=named_options(args.option),
    )
    finished = run_command(command, options)
    if not finished.attached:
        print(unguarded_line(args.run_dir, finished.reasons, finished.own_guard), file=sys.stderr)
    return finished.code


if __name__ == "__main__":
    sys.exit(main())
