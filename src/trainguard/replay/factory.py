"""The replay factory: ``--factory MODULE:FUNC`` (or a callable, or a ReplaySpec) to the
model and ``loss_fn`` a replay re-runs the step with.

The factory's module is imported, and the factory called, as ``python FILE`` would run
them: ``sys.argv`` holds only the module's name (a training script that parses its command
line gets its defaults, not the replay's own options), and what they write to stderr is
held back and written out after. A ``sys.exit()`` at import or in the call (an argument
parser that requires options) is a ReplayError naming the fix, not the end of the replay;
so is an import that fails inside the module (a missing dependency, a syntax error), which
is told apart from a module that is not found.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import io
import os
import sys
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from torch import Tensor, nn

from trainguard.capture import batchcodec
from trainguard.errors import ReplayError

__all__ = ["Factory", "ReplaySpec", "first_line", "resolve_factory"]


@dataclass
class ReplaySpec:
    """What a replay factory returns: the model (fresh weights are fine: the bundle's are
    loaded into it) and ``loss_fn(model, batch) -> scalar loss``."""

    model: nn.Module
    loss_fn: Callable[[nn.Module, Any], Tensor]


Factory = Callable[..., Any]
"""``make()`` or ``make(config)``: the second gets the run's ``GuardConfig.factory_config``."""

NO_ARGV_FIX = (
    "it parses the command line or exits when called, and a replay passes it no options: "
    "give those options defaults (or read them from the environment), or point --factory at "
    "a function that builds the model without parsing sys.argv"
)


def resolve_factory(
    factory: str | Factory | ReplaySpec, config: dict[str, Any] | None = None
) -> ReplaySpec:
    """A ReplaySpec from ``"module:func"`` / ``"path/to/file.py:func"``, a callable or a spec.
    ``config``: the bundle's ``factory_config``, passed to a factory that takes an argument."""
    if isinstance(factory, ReplaySpec):
        return _checked(factory, "the ReplaySpec")
    name = factory if isinstance(factory, str) else getattr(factory, "__qualname__", "factory")
    func = _import_factory(factory) if isinstance(factory, str) else factory
    module = sys.modules.get(getattr(func, "__module__", None) or "")
    if module is not None:  # the script's own batch types, defined in __main__ when it ran
        batchcodec.main_stand_in(module)
    argv0 = factory.rpartition(":")[0] if isinstance(factory, str) else None
    made = _call(func, name, argv0, _arguments(func, name, config))
    if isinstance(made, ReplaySpec):
        return _checked(made, name)
    if isinstance(made, tuple) and len(made) == 2:
        return _checked(ReplaySpec(made[0], made[1]), name)
    raise ReplayError(
        f"--factory {name}: must return (model, loss_fn) or trainguard.ReplaySpec, got "
        f"{type(made).__name__}"
    )


def _arguments(func: Factory, name: str, config: dict[str, Any] | None) -> tuple[Any, ...]:
    """``()`` for ``make()``, ``(config,)`` for ``make(config)`` (a ReplayError when the
    bundle holds no config for it: the run gave the guard none)."""
    try:
        params = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):  # a builtin or C callable: called without arguments
        return ()
    required = [
        p
        for p in params
        if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    if not required:
        return ()
    if config is None:
        raise ReplayError(
            f"--factory {name}: it takes an argument (the run's factory_config), and the "
            "bundle holds none: pass factory_config={...} to the Guard of the run, or make "
            "the factory take no argument"
        )
    return (config,)


def _call(func: Factory, name: str, argv0: str | None, args: tuple[Any, ...] = ()) -> Any:
    """``func(*args)`` as a script would run it (``argv0``: ``sys.argv`` is ``[argv0]``
    meanwhile; None leaves it alone): its exit, or any exception but KeyboardInterrupt, is a
    ReplayError."""
    with _as_script(argv0) as said:
        try:
            return func(*args)
        except KeyboardInterrupt:
            raise
        except SystemExit as exc:
            raise ReplayError(
                f"--factory {name}: calling {name} exited with {_status(exc)}{_quoted(said)}: "
                f"{NO_ARGV_FIX}"
            ) from None
        except Exception as exc:
            raise ReplayError(
                f"--factory {name}: calling it raised {type(exc).__name__}: {first_line(exc)}"
            ) from exc
        except BaseException as exc:
            raise ReplayError(
                f"--factory {name}: calling {name} raised {type(exc).__name__}: "
                f"{first_line(exc)}; make it return (model, loss_fn) instead"
            ) from exc


@contextlib.contextmanager
def _as_script(argv0: str | None) -> Iterator[io.StringIO]:
    """``sys.argv`` is ``[argv0]`` (None: as it is) and stderr is held back meanwhile; what
    was held back (less what ``_quoted`` took) is written out after."""
    saved, said = sys.argv, io.StringIO()
    if argv0 is not None:
        sys.argv = [argv0]
    try:
        with contextlib.redirect_stderr(said):
            yield said
    finally:
        sys.argv = saved
        sys.stderr.write(said.getvalue())


def _quoted(said: io.StringIO) -> str:
    """The last line held back on stderr (an argument parser's error), as ``": LINE"``; the
    rest is dropped (the error quotes it instead)."""
    last = said.getvalue().strip().splitlines()[-1:]
    said.seek(0)
    said.truncate()
    return f": {last[0][:200]}" if last else ""


def _status(exc: SystemExit) -> str:
    code = exc.code
    if code is None or isinstance(code, int):
        return f"status {code or 0}"
    return f"status 1 (sys.exit({code!r:.200}))"


def _checked(spec: ReplaySpec, name: str) -> ReplaySpec:
    if not isinstance(spec.model, nn.Module):
        raise ReplayError(
            f"--factory {name}: the model must be a torch.nn.Module, got "
            f"{type(spec.model).__name__}"
        )
    if not callable(spec.loss_fn):
        raise ReplayError(
            f"--factory {name}: loss_fn must be callable as loss_fn(model, batch), got "
            f"{type(spec.loss_fn).__name__}"
        )
    return spec


def _import_factory(spec: str) -> Factory:
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise ReplayError(f"--factory: expected MODULE:FUNC (e.g. train:make_replay), got {spec!r}")
    module = _import_module(module_name, spec)
    func = module
    for part in attr.split("."):
        func = getattr(func, part, None)
        if func is None:
            raise ReplayError(f"--factory {spec}: {module_name} has no attribute {attr!r}")
    if not callable(func):
        raise ReplayError(f"--factory {spec}: {attr} is not callable")
    return cast(Factory, func)


def _import_module(name: str, spec: str) -> Any:
    """Import ``name`` (a file or a module) as ``python FILE`` / ``python -m MODULE`` would
    see it (``_as_script``); a ``sys.exit()`` at import is a ReplayError naming the fix and
    quoting the module's last line on stderr."""
    with _as_script(name) as said:
        try:
            return _import_module_as_script(name, spec)
        except SystemExit as exc:
            raise ReplayError(
                f"--factory {spec}: importing {name} exited (sys.exit({exc.code!r})"
                f"{_quoted(said)}): it runs a script at import; put the factory in a module "
                "that only defines things, or move the script's code under `if __name__ == "
                '"__main__":`'
            ) from None


def _import_module_as_script(name: str, spec: str) -> Any:
    try:
        if name.endswith(".py") or os.sep in name:
            return _import_file(name, spec)
        if os.getcwd() not in sys.path and "" not in sys.path:
            sys.path.insert(0, os.getcwd())  # like `python -m`: modules next to you import
        return importlib.import_module(name)
    except ReplayError:
        raise
    except Exception as exc:
        if isinstance(exc, ModuleNotFoundError) and _is_the_module(exc.name, name):
            raise ReplayError(
                f"--factory {spec}: cannot import {name} ({type(exc).__name__}: "
                f"{first_line(exc)}); run from the folder that holds it or add it to PYTHONPATH"
            ) from exc
        raise ReplayError(_import_failure(name, spec, exc)) from exc


def _import_file(name: str, spec: str) -> Any:
    path = Path(name)
    if not path.is_file():
        raise ReplayError(f"--factory {spec}: no such file {name}")
    folder = str(path.resolve().parent)
    if folder not in sys.path:  # like `python file.py`: its sibling modules import
        sys.path.insert(0, folder)
    loaded = importlib.util.spec_from_file_location(path.stem, path)
    if loaded is None or loaded.loader is None:
        raise ReplayError(f"--factory {spec}: cannot load {name}")
    module = importlib.util.module_from_spec(loaded)
    sys.modules.setdefault(path.stem, module)
    try:
        loaded.loader.exec_module(module)
    except BaseException:
        if sys.modules.get(path.stem) is module:  # no half-run module left behind
            del sys.modules[path.stem]
        raise
    return module


def _is_the_module(missing: str | None, name: str) -> bool:
    """The module not found is ``name`` itself (or a package above it), not one it imports."""
    return missing is not None and (name == missing or name.startswith(missing + "."))


def _import_failure(name: str, spec: str, exc: Exception) -> str:
    """The one line of a module that was found but whose own import raised."""
    if isinstance(exc, SyntaxError):
        where = _shown(exc.filename, exc.lineno) or name
        what = f"SyntaxError: {exc.msg} at {where}"
        fix = f"fix the syntax error at {where}"
    else:
        at = _raised_at(exc)
        what = f"{type(exc).__name__}: {first_line(exc)}" + (f" at {at}" if at else "")
        if isinstance(exc, ModuleNotFoundError):
            fix = f"install {exc.name or 'it'} where the replay runs, or fix that import"
        else:
            fix = "fix that error (the factory's module must import cleanly)"
    return f"--factory {spec}: {name} was found, but importing it failed ({what}); {fix}"


def _raised_at(exc: BaseException) -> str | None:
    """``file:line`` of the innermost frame of ``exc``'s traceback outside the import
    machinery."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith("<")]
    frames = [f for f in frames if os.path.basename(os.path.dirname(f.filename)) != "importlib"]
    if not frames or frames[-1].filename == __file__:
        return None
    return _shown(frames[-1].filename, frames[-1].lineno)


def _shown(filename: str | None, line: int | None) -> str | None:
    """``file:line``, the file relative to the current folder when it is under it."""
    if not filename:
        return None
    shown = filename
    with contextlib.suppress(ValueError):
        relative = os.path.relpath(filename)
        shown = filename if relative.startswith("..") else relative
    return f"{shown}:{line}" if line else shown


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (at most 300 characters)."""
    lines = str(exc).strip().splitlines()
    return lines[0][:300] if lines else type(exc).__name__
