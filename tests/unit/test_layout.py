"""The package's parts import in one direction (README "Layout"): a change that makes a part
import one it must not (e.g. the step path importing replay) fails here, lazy imports
inside functions included."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import trainguard

PACKAGE = Path(trainguard.__file__).parent

BASE = "base"
"""Top-level modules below every part (errors, config, events, progress, ...)."""
TOP = "top"
"""Top-level modules above the parts: they may import anything."""
TOP_MODULES = {"__init__", "__main__", "cli", "demo", "testing", "doctor", "report"}
BASE_PACKAGES = {"runs", "distributed", "config"}
"""Packages of the base layer: shared plumbing below every part, like the base modules."""
MAX_TOP_LEVEL = 12
"""Modules at the package's top level, at most (DESIGN.md)."""

ALLOWED: dict[str, set[str]] = {
    BASE: {BASE},
    "capture": {BASE, "capture"},
    "hang": {BASE, "hang"},
    "replay": {BASE, "replay", "capture"},
    "recovery": {BASE, "recovery", "capture"},
    "step": {BASE, "step", "capture", "hang", "recovery", "health"},
    "health": {BASE, "health"},
    "integrations": {BASE, "integrations", "step", "capture", "recovery", "hang", "health"},
    "attach": {BASE, "attach", "step", "capture", "recovery", "hang", "health"},
    "doctor": {BASE, "doctor"},
    "report": {BASE, "report", "capture", "hang"},
    # report reads a signal's stacks as the watchdog reads a live one (hang.frames)
}


def part_of_file(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    if len(rel.parts) > 1:
        return BASE if rel.parts[0] in BASE_PACKAGES else rel.parts[0]
    return TOP if rel.stem in TOP_MODULES else BASE


def part_of_module(name: str) -> str | None:
    """The part a ``trainguard...`` module belongs to (None: not ours)."""
    parts = name.split(".")
    if parts[0] != "trainguard":
        return None
    if len(parts) == 1:
        return TOP
    if (PACKAGE / parts[1]).is_dir():
        return BASE if parts[1] in BASE_PACKAGES else parts[1]
    return TOP if parts[1] in TOP_MODULES else BASE


def imported_modules(path: Path) -> list[str]:
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
            # ``from trainguard import capture``: the names may be subpackages/modules
            if node.module == "trainguard":
                names.extend(f"trainguard.{alias.name}" for alias in node.names)
    return names


def violations() -> list[str]:
    found: list[str] = []
    for path in sorted(PACKAGE.rglob("*.py")):
        mine = part_of_file(path)
        if mine == TOP:
            continue
        allowed = ALLOWED.get(mine, {BASE, mine})
        for name in imported_modules(path):
            theirs = part_of_module(name)
            if theirs is not None and theirs not in allowed:
                found.append(f"{path.relative_to(PACKAGE)} ({mine}) imports {name} ({theirs})")
    return found


def test_parts_import_in_one_direction() -> None:
    assert violations() == []


def test_every_subpackage_says_what_it_offers() -> None:
    for init in sorted(PACKAGE.glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and "Offers" in doc, f"{init.parent.name}/__init__.py: docstring names no offers"


def test_the_checker_sees_a_backward_import(tmp_path: Path) -> None:
    """The rule itself: a base module importing the step path would be reported."""
    assert part_of_module("trainguard.step.guard") == "step"
    assert part_of_module("trainguard.events") == BASE
    assert part_of_module("trainguard.cli") == TOP
    assert "step" not in ALLOWED["replay"] and "hang" not in ALLOWED["replay"]
    assert "replay" not in ALLOWED["step"]
    fake = tmp_path / "m.py"
    fake.write_text("def f():\n    from trainguard.step.guard import Guard\n")
    assert "trainguard.step.guard" in imported_modules(fake)


def test_replay_name_is_the_function() -> None:
    """``tg.replay`` is the public function even though ``trainguard/replay/`` is a package."""
    import trainguard.replay.stepper  # a submodule import must not rebind the name

    assert callable(trainguard.replay)
    assert trainguard.replay.__name__ == "replay"  # the function (it imports the runner
    assert trainguard.replay.__module__ == "trainguard.replay"  # when called: no torch before)


def test_import_trainguard_imports_no_torch() -> None:
    """``trainguard --version``, ``report`` and ``trainguard run``'s bootstrap pay for what
    they use: the public names that need torch are imported when first used."""
    code = (
        "import sys, trainguard, trainguard.cli, trainguard.attach.launch\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "assert trainguard.Guard.__name__ == 'Guard' and 'torch' in sys.modules\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def module_imports(path: Path, modules: set[str]) -> set[str]:
    """The modules ``path`` imports; ``from package import module`` names the module (not
    the package's ``__init__``)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = {f"{node.module}.{alias.name}" for alias in node.names}
            named = subs & modules
            found.update(named)
            if named != subs and node.module in modules:
                found.add(node.module)
    return found


def import_cycles() -> list[list[str]]:
    """Cycles among trainguard's modules, counting every import (``TYPE_CHECKING`` blocks and
    imports inside functions too): a part gets what it needs passed in instead."""
    graph: dict[str, set[str]] = {}
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    for name, path in modules.items():
        graph[name] = {m for m in module_imports(path, set(modules)) if m != name}
    cycles: list[list[str]] = []
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append([*trail[trail.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt, [*trail, nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    return cycles


def test_no_import_circle() -> None:
    """Issue 23: ``step/syncfree.py`` imported ``Guard`` (under ``TYPE_CHECKING``) while the
    guard imports it; the sync-free step now gets its parts passed in."""
    assert import_cycles() == []


def test_the_cycle_finder_sees_a_type_checking_circle(tmp_path: Path) -> None:
    fake = tmp_path / "m.py"
    fake.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from a.b import C\n")
    assert module_imports(fake, {"a.b", "a"}) == {"a.b"}


def test_importing_trainguard_changes_no_environment_variable() -> None:
    """No import-time side effects: the flight recorder's variable is set by trainguard's own
    launchers for their workers, never by ``import trainguard``."""
    import subprocess
    import sys

    code = (
        "import os; before = dict(os.environ); import trainguard, trainguard.hang; "
        "print(sorted(set(os.environ.items()) ^ set(before.items())))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# -- the map: docs/architecture.md and the README's layout, from this table ---------------

REASONS: dict[str, str] = {
    BASE: "shared types and plumbing every part may use (errors, options, events, exit codes, "
    "numerics, the hooks put on the user's modules; `runs/`: which run a guard writes; "
    "`distributed/`: torchrun's environment, objects between ranks): imports nothing above it",
    "step": "the pipeline inside the loop, every rank, every step: measure this rank's row, "
    "agree (one all-reduce), decide from the agreed record, apply, record; `Guard` composes it",
    "capture": "bundles: the format, written atomically, read back and checked; batches, RNG "
    "states, optimizer state; replay and inspect read them without the step path",
    "replay": "re-running a bundle (or a live step) offline and diagnosing it: the first bad "
    "op, its module and line, the culprit samples, the verdict; never imports the step path",
    "hang": "the watchdog thread: heartbeats over the job's c10d store, hang and dead-rank "
    "verdicts, stack dumps and reports; the loop's progress it watches",
    "health": "cross-rank rules on numbers the step already agreed on: stragglers, replica "
    "agreement, learning rates; fed by the step, imports the base only",
    "recovery": "keeping a run alive: in-memory snapshots, checkpoints on disk, rollback and "
    "its ladder, resume, the stop record that refuses a hopeless restart",
    "attach": "`trainguard run`: the guard on an unmodified script, from process-wide hooks, "
    "through the Guard's own API",
    "integrations": "Lightning and Hugging Face callbacks and TensorBoard: compose `Guard`; "
    "their frameworks are extras, imported lazily",
    "report": "`trainguard report`: reads a run dir offline into a summary, text, HTML, plot",
    "doctor": "`trainguard doctor`: the environment, rendezvous and collectives checked before "
    "a job, base only",
    TOP: "the command line and the demo, above every part",
}
"""Why each folder is one: the map's text (every part must have one)."""

MAP_BEGIN = "<!-- layout: generated by tests/unit/test_layout.py; do not edit by hand -->"
MAP_END = "<!-- end of layout -->"


def _summary(path: Path) -> str:
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return " ".join(doc.split("\n\n")[0].split()).replace("|", "\\|")


def _modules(part: str) -> list[Path]:
    if part == TOP:
        return sorted(p for p in PACKAGE.glob("*.py") if p.stem in TOP_MODULES)
    if part == BASE:
        top = [p for p in PACKAGE.glob("*.py") if p.stem not in TOP_MODULES]
        packaged = [p for name in BASE_PACKAGES for p in (PACKAGE / name).glob("*.py")]
        return sorted(top) + sorted(p for p in packaged if p.stem != "__init__")
    return sorted(p for p in (PACKAGE / part).rglob("*.py") if p.stem != "__init__")


def render_map() -> str:
    """The layout: each part, why it is one, what it may import, and its modules with the
    first paragraph of each one's docstring."""
    lines = [MAP_BEGIN, ""]
    for part, why in REASONS.items():
        title = part if part in (BASE, TOP) else f"{part}/"
        imports = ", ".join(sorted(ALLOWED.get(part, {BASE, part}) - {part}))
        rule = "anything" if part == TOP else (imports or "nothing of trainguard")
        lines += [f"### {title}", "", f"{why}. Imports: {rule}.", ""]
        lines += ["| module | what it holds |", "|---|---|"]
        for path in _modules(part):
            name = str(path.relative_to(PACKAGE if part in (BASE, TOP) else PACKAGE / part))
            lines.append(f"| `{name}` | {_summary(path)} |")
        lines.append("")
    lines.append(MAP_END)
    return "\n".join(lines)


def render_readme_table() -> str:
    rows = [MAP_BEGIN, "", "| room | what it does |", "|---|---|"]
    for part, why in REASONS.items():
        rows.append(f"| {part if part in (BASE, TOP) else f'`{part}/`'} | {why} |")
    return "\n".join([*rows, "", MAP_END])


def _generated(path: Path) -> str:
    text = path.read_text()
    return text[text.index(MAP_BEGIN) : text.index(MAP_END) + len(MAP_END)]


def test_the_top_level_holds_twelve_modules_at_most() -> None:
    modules = sorted(p.stem for p in PACKAGE.glob("*.py"))
    assert len(modules) <= MAX_TOP_LEVEL, modules


def test_every_part_has_its_reason_and_the_maps_are_the_code() -> None:
    parts = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert parts - BASE_PACKAGES == set(REASONS) - {BASE, TOP}
    docs = PACKAGE.parents[1] / "docs" / "architecture.md"
    readme = PACKAGE.parents[1] / "README.md"
    fix = "regenerate: python tests/unit/test_layout.py"
    assert _generated(docs) == render_map(), fix
    assert _generated(readme) == render_readme_table(), fix


UNIT_TESTS = Path(__file__).resolve().parent
WHOLE_PACKAGE_TESTS = {"test_layout.py", "test_public_api.py", "test_user_hooks.py", "test_cuda.py"}
"""The unit tests at ``tests/unit``'s top: the package as a whole (its layout, its public API,
what it leaves in the user's objects, its CUDA paths across parts)."""


def test_the_unit_tests_mirror_the_package() -> None:
    """``tests/unit/<part>/`` holds the tests of ``src/trainguard/<part>/``: a test file goes
    in the folder of the part whose behaviour it pins, so the next move of a part moves one
    folder of tests with it."""
    parts = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    folders = {p.name for p in UNIT_TESTS.iterdir() if p.is_dir() and any(p.glob("test_*.py"))}
    assert folders <= parts, f"no src/trainguard/ part for tests/unit/{sorted(folders - parts)}"
    loose = {p.name for p in UNIT_TESTS.glob("test_*.py")} - WHOLE_PACKAGE_TESTS
    assert not loose, f"move into tests/unit/<part>/ (the part they test): {sorted(loose)}"


def _write(path: Path, block: str) -> None:
    text = path.read_text()
    start, end = text.index(MAP_BEGIN), text.index(MAP_END) + len(MAP_END)
    path.write_text(text[:start] + block + text[end:])


if __name__ == "__main__":
    _write(PACKAGE.parents[1] / "docs" / "architecture.md", render_map())
    _write(PACKAGE.parents[1] / "README.md", render_readme_table())
