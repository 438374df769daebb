"""``python fast_exit.py SCRIPT ARGS...``: run ``SCRIPT`` as ``__main__``, then end the process
without the interpreter's finalization (``exit_without_finalizing``).

Why: under gloo, a framework's collectives (the HF Trainer's ``store_flos`` all_gather at the
end of training) hand the process group tensors that have Python objects. When gloo's worker
thread drops the last reference to one only after the main thread began finalizing, Python
3.11 ends that thread inside a ``noexcept`` frame and the process aborts ("terminate called
without an active exception"; pytorch/pytorch#190489): about one run in three on these 2
cores with two CPU hogs beside it. ``destroy_process_group()`` does not help: DDP still holds
the group, so its worker threads live on. The guard's own collectives are safe from this
(``trainguard/step/held_work.py``); a framework's are not the guard's to hold. The tests that
launch such scripts check the guard, not PyTorch's exit, so they exit before that race.
"""

from __future__ import annotations

import logging
import os
import runpy
import sys


def exit_without_finalizing(code: int = 0) -> None:
    """Flush what the process wrote and end it at once (``os._exit``): no atexit handlers,
    no wait for other threads (a capture's background fsync is cut short: the files are
    written, only their flush to disk is skipped)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main() -> None:
    script, *args = sys.argv[1:]
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:  # the script's own exit status; an exception propagates
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    exit_without_finalizing(code)


if __name__ == "__main__":
    main()
