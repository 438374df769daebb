"""``trainguard doctor``: find a broken distributed set-up before a long job starts.

- ``environment``      versions, GPUs and driver, visible devices, /dev/shm, open files
- ``flight_recorder``  torch's flight recorder on or off (what a hang report can compare)
- ``variables``        the NCCL / TORCH_NCCL / gloo / c10d variables set, and risky values
- ``rendezvous``       RANK/WORLD_SIZE/LOCAL_* consistent, MASTER_ADDR resolves, MASTER_PORT
- ``checkin``          every rank checks in through the store; missing ranks named in time
- ``compare``          every rank's versions and variables; the odd ranks named
- ``smoke``            the collectives, their results checked, and a bandwidth figure
- ``collective_phase`` the smoke test under a deadline; results exchanged across ranks
- ``smoke_results``    those results as a table and findings
- ``session``          the cross-rank part, in order
- ``run``              ``run_doctor``: all of it for this process
- ``findings``         ``Finding``, ``DoctorReport``, the exit code
- ``render``           text output

Offers: ``run_doctor``, ``DoctorOptions``, ``DoctorReport``, ``Finding``, ``report_text``.
Imports only the shared base and torch (a top-level tool: never the step path).
"""

from trainguard.doctor.findings import DoctorReport, Finding
from trainguard.doctor.render import report_text
from trainguard.doctor.run import DoctorOptions, run_doctor

__all__ = ["DoctorOptions", "DoctorReport", "Finding", "report_text", "run_doctor"]
