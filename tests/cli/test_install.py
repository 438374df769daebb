"""The README's install line works: ``pip install .`` into a fresh venv, then import + CLI.

No network: the wheel is built from a copy of the checkout with the development venv's
setuptools (``--no-build-isolation``), the fresh venv's own pip installs it with
``--no-index --no-deps``, and torch (the user's own build in real life) comes from the
development venv through a ``.pth`` file placed after the fresh venv's site-packages, so the
trainguard that imports is the installed one. The README's table of extras is checked
against pyproject.toml. About 30-60 s on the shared 2-core machine (the venv's pip, two
imports of torch).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest
import torch

import trainguard

ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PIP_"))}
    return dict(env, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")


def _run(command: list[str | Path], cwd: Path) -> str:
    done = subprocess.run(
        [str(c) for c in command], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=150
    )
    assert done.returncode == 0, f"{command}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    return done.stdout


def _readme_extras() -> dict[str, str]:
    """The README's extras table: extra -> the 'brings' cell."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Install into your own environment", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([a-z]+)` \| ([^|]+) \|", section, flags=re.MULTILINE)
    return {name: brings for name, brings in rows}


def test_readme_lists_every_extra_with_its_requirements() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    listed = _readme_extras()
    assert set(listed) == set(extras)
    for name, requirements in extras.items():
        if name != "dev":
            for requirement in requirements:
                assert f"`{requirement}`" in listed[name], (name, requirement)


@pytest.mark.timeout(240)
def test_pip_install_into_a_fresh_venv(tmp_path: Path) -> None:
    source = tmp_path / "source"  # a copy: the build writes build/ and *.egg-info in place
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    shutil.copytree(ROOT / "src", source / "src", ignore=ignore)
    wheels = tmp_path / "wheels"
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
          "--no-index", "-w", wheels, source], tmp_path)  # fmt: skip
    (wheel,) = wheels.glob("trainguard-*.whl")

    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    _run([python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", wheel], tmp_path)
    purelib = Path(
        _run(
            [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], tmp_path
        ).strip()
    )
    torch_site = Path(torch.__file__).resolve().parents[1]  # torch, as the user's own build
    (purelib / "zz_torch_from_dev_venv.pth").write_text(f"{torch_site}\n")

    version = _run([env_dir / "bin" / "trainguard", "--version"], tmp_path)
    assert version.strip() == f"trainguard {trainguard.__version__}"
    where = _run(
        [python, "-c", "import trainguard, importlib.metadata as m; "
         "print(trainguard.__file__); print(m.requires('trainguard'))"],
        tmp_path,
    )  # fmt: skip
    path, requires = where.splitlines()
    assert Path(path).resolve().is_relative_to(purelib.resolve()), path  # not the checkout
    assert "torch>=2.4" in requires
    metadata = next(purelib.glob("trainguard-*.dist-info")) / "METADATA"
    assert "Provides-Extra: lightning" in metadata.read_text()
