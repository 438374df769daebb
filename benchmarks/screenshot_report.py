"""Screenshot a run's ``report.html`` in a real headless browser (Chromium).

Usage::

    apt-get update && apt-get install -y chromium      # Debian's Chromium (not in the Makefile)
    trainguard demo --run-dir runs/demo                 # a real 2-rank run with a NaN step
    trainguard report runs/demo                         # writes runs/demo/report.html
    python benchmarks/screenshot_report.py runs/demo/report.html docs/img/report.png

The page is self-contained (the timeline is an inline PNG), so the browser needs no network;
the flags below keep Chromium from reaching out (updates, sync, QUIC) anyway.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def find_browser() -> str | None:
    return next((path for name in BROWSERS if (path := shutil.which(name))), None)


def screenshot_command(browser: str, page: Path, out: Path, profile: str, size: str) -> list[str]:
    return [
        browser,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--hide-scrollbars",
        f"--user-data-dir={profile}",
        f"--screenshot={out}",
        f"--window-size={size}",
        page.resolve().as_uri(),
    ]


def screenshot(page: Path, out: Path, size: str = "1200,900", timeout: float = 60.0) -> Path:
    """Render ``page`` with headless Chromium into the PNG ``out``; raises when it fails."""
    browser = find_browser()
    if browser is None:
        raise FileNotFoundError("no chromium on PATH: apt-get install -y chromium")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(prefix="tg-chromium-") as profile:
        cmd = screenshot_command(browser, page, out.resolve(), profile, size)
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    if not out.is_file() or out.stat().st_size == 0:
        raise RuntimeError(f"chromium wrote no screenshot (exit {done.returncode}): {done.stderr}")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("page", type=Path, help="a report.html")
    parser.add_argument("out", type=Path, help="the PNG to write")
    parser.add_argument("--size", default="1200,900", help="window size WIDTH,HEIGHT")
    args = parser.parse_args()
    if not args.page.is_file():
        print(f"screenshot_report: no such page: {args.page}", file=sys.stderr)
        return 2
    try:
        path = screenshot(args.page, args.out, args.size)
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as exc:
        print(f"screenshot_report: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {path} ({path.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
