"""``trainguard run``: the guard attached to an unmodified training script from the outside.

One concept per module: ``options`` (the command's options and the environment that carries
them to every process), ``bootstrap/sitecustomize.py`` (runs at each process's start-up and
installs the hooks once torch is imported), ``prestart`` (the first step's start, recorded
before the guard exists), ``discovery`` (which module is the model; a guard already there),
``hooks`` (the optimizer and model hooks, the guard they attach, standing aside),
``leaving`` (every rank of a job standing aside together), ``announce`` (the lines it says),
``clip`` (a script's gradient clip: checked before it), ``drops`` (a step the script leaves
out itself, seen at its ``zero_grad``) and ``launch`` (running the command, its exit
status). See docs/run.md.

Offers: ``trainguard.attach.launch`` behind the ``trainguard run`` command; nothing here is
imported by ``import trainguard``. Sits above the step path (like the integrations): it
builds a ``Guard`` and feeds it from hooks, and no part below imports it.
"""
