"""The watchdog: hung and dead ranks found within a timeout, stacks dumped, every rank exits.

- ``watchdog``  one thread per rank: heartbeats out, verdicts in (the tick), start and stop
- ``exit_path`` acting on a verdict: stack dump, report, await the others' dumps, exit code
- ``failure``   this rank's own exception, published from the main thread (and excepthook)
- ``heartbeat`` what a rank publishes, and what the others make of it (``PeerTracker``)
- ``channel``   the job's c10d store as the transport (own connections, one multi_get a tick)
- ``watchers``  who reads whose heartbeats: a few watcher ranks read all, the others theirs
- ``keys``      the store key prefix, the hang id candidate, the rank serving the store
- ``rules``     culprits of a hang or a dead peer (``assess``), and verdicts
- ``timeout``   the fixed or learned hang timeout (``StallMeter`` measures what it learns
  from), and the cadences derived from it
- ``report``    ``run_dir/hangs/<id>/report.json``
- ``stacks``    stack dumps: every thread, py-spy when installed, faulthandler fallback
- ``collectives`` the collective a stalled rank waits in (``CollectiveProbe``), from
  ``flight_recorder`` (torch's record of the group's collectives) or ``frames`` (the main
  thread's Python stack), as a ``collective_record.CollectiveRecord``
- ``mismatch``  the ranks' collectives compared: the first differing one, and the culprits

Importing changes nothing (no import-time side effects): the flight recorder is turned on by
the launchers trainguard controls (``trainguard demo``) through the workers' environment
(``flight_recorder.enable_by_default``); torch 2.13 records 2000 collectives by default, and
``trainguard doctor`` says how to turn it on where it is off.

Offers: ``Watchdog``, ``start_watchdog``. Imports only the shared base modules
(``progress``, ``events``, ``exitcodes``, ``errors``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainguard.lazy_names import lazy_names

if TYPE_CHECKING:
    from trainguard.hang.watchdog import Watchdog
    from trainguard.hang.watchdog_start import start_watchdog

__all__ = ["Watchdog", "start_watchdog"]

_LAZY = {"Watchdog": "trainguard.hang.watchdog", "start_watchdog": "trainguard.hang.watchdog_start"}
"""Imported on first use: ``trainguard report`` reads a hang's stacks (``frames``) without
importing torch."""


__getattr__, __dir__ = lazy_names(__name__, _LAZY, __all__)
