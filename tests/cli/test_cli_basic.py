"""The console script itself: --version, --help, and bad usage (exit 2, one line)."""

from __future__ import annotations

import subprocess
import sys

import trainguard as tg


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trainguard.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_version() -> None:
    out = _run("--version")
    assert out.returncode == 0
    assert out.stdout.strip() == f"trainguard {tg.__version__}"


def test_help_lists_usage() -> None:
    out = _run("--help")
    assert out.returncode == 0
    assert "usage: trainguard" in out.stdout


def test_unknown_command_is_one_line_exit_2() -> None:
    out = _run("frobnicate")
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("trainguard: ")
    assert "Traceback" not in out.stderr


def test_python_dash_m_trainguard_is_the_console_script() -> None:
    """``python -m trainguard`` (not only ``python -m trainguard.cli``) runs the CLI."""
    out = subprocess.run(
        [sys.executable, "-m", "trainguard", "--version"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("trainguard ")
    bad = subprocess.run(
        [sys.executable, "-m", "trainguard", "no-such-command"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2
    assert len(bad.stderr.strip().splitlines()) == 1
