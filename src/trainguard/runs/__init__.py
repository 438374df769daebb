"""Which run a guard writes, and which guards of the process write which run dirs.

- ``identity``  the run of ``run_dir`` a guard writes: a new one, a torchrun restart's or a
                resume's continuation, or one named; its id is on every event
- ``dirs``      the open guards of the process and the run dirs they write (two guards on
                one run dir are refused)
- ``reached_mark`` rank 0's last recorded step in a memory-mapped file: how far a killed
                process got, for the report

Offers (by module): ``identify_run``, ``RunIdentity``, ``latest_run`` (``identity``);
``claim`` (``dirs``); ``ReachedMark``, ``read_marks`` (``reached_mark``). Base plumbing:
imports nothing of the guard's parts.
"""
