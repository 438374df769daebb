"""Process exit codes of a run that the guard ended.

When the watchdog or the guard ends a run it ends every live rank with one of these codes
(the watchdog and a refused restart with ``os._exit``), so a launcher (torchrun, a job
scheduler) or a wrapper script can tell what happened from the exit status alone:

========================  ====  ==========================================================
constant                  code  meaning
========================  ====  ==========================================================
``EXIT_HANG``             91    no rank progressed for ``hang_timeout``; report under
                                ``run_dir/hangs/<id>/`` (``kind: "hang"``)
``EXIT_PEER_FAILURE``     92    another rank died, froze, or failed with an exception
                                (``kind: "peer_failure"``)
``EXIT_DO_NOT_RESTART``   93    a restart would resume into the failure that stopped the
                                last attempt, with nothing changed (``run_dir/stop.json``;
                                ``restart_refused`` event); torchrun's agent is stopped
                                so that it does not restart again (docs/recovery.md)
``EXIT_SUSPECT_HOST``     94    a host had ``suspect_host_after`` transient faults (a bad
                                step that was finite when rerun in place) within
                                ``suspect_host_window`` steps: drain it and restart
                                elsewhere (``suspect_host`` event; every rank exits)
========================  ====  ==========================================================

The values avoid the codes that mean something else already: 1 and 2 (Python errors and
usage), 64-78 (``sysexits.h``), 126-127 (shell) and 128+N (killed by signal N).

Two ranks do not exit with these codes: a rank whose own exception caused a peer failure
ends with that exception (Python's exit status 1), and a rank whose interpreter is frozen
(its main thread holds the GIL in C code) is ended by :mod:`faulthandler` after it dumped
its stacks, with status 1.
"""

from __future__ import annotations

EXIT_HANG = 91
"""Every rank of a hung job exits with this code."""

EXIT_PEER_FAILURE = 92
"""Survivors of a dead, frozen or failed rank exit with this code."""

EXIT_DO_NOT_RESTART = 93
"""Every rank of a restarted attempt exits with this code when the restart cannot help: it
would resume from the same checkpoint, with the same config and data, into the failure that
stopped the last attempt (``trainguard.recovery.restart``)."""

EXIT_SUSPECT_HOST = 94
"""Every rank exits with this code when a host keeps making transient faults (``rerun``)."""
