"""docs/options.md is the options' own text: every option, its name, default and docstring,
read from ``trainguard/config/`` itself, so the page cannot go stale. Regenerate it with
``python tests/unit/config/test_options_doc.py``."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import sys
from pathlib import Path

import trainguard as tg
from trainguard import config as options

DOC = Path(__file__).resolve().parents[3] / "docs" / "options.md"

HEAD = """# Options

Every option of `tg.Guard`, generated from `src/trainguard/config/` (the text is each
option's docstring; `tests/unit/config/test_options_doc.py` keeps this page equal to it).

`GuardConfig` holds what the step itself uses; each section is read by one part of the
guard. The options people set are `tg.Guard` keywords (marked **keyword**); a section
goes in whole (`spikes=tg.SpikeConfig(warmup=20)`), or any option by name, as a file or a
command line has it: `tg.GuardConfig.from_options({"on_spike": "skip", "spikes.warmup":
20})`, `trainguard run -o spikes.warmup=20` (values parsed: `none`, `true`/`false`, numbers,
comma-separated names). An unknown name is a `tg.ConfigError` naming the closest one; a
name of the flat options of before names where it went (`spike_warmup: this option is
spikes.warmup now`).
"""


def _docstrings(cls: type) -> dict[str, str]:
    """The docstring under each field of ``cls`` (attribute docstrings, read from source)."""
    tree = ast.parse(Path(inspect.getsourcefile(cls) or "").read_text())
    body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
    found: dict[str, str] = {}
    for node, after in zip(body.body, body.body[1:], strict=False):
        if not isinstance(node, ast.AnnAssign) or not isinstance(node.target, ast.Name):
            continue
        if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
            found[node.target.id] = " ".join(str(after.value.value).split())
    return found


def _default(field: dataclasses.Field[object]) -> str:
    if field.default is not dataclasses.MISSING:
        return f"`{field.default!r}`"
    if field.default_factory is not dataclasses.MISSING:
        return f"`{field.default_factory()!r}`"
    return ""


def _table(cls: type, prefix: str) -> list[str]:
    keywords = {f"{s}.{k}": name for name, (s, k) in options.KEYWORDS.items()}
    docs = _docstrings(cls)
    rows = ["| option | default | meaning |", "|---|---|---|"]
    for field in dataclasses.fields(cls):
        if field.name in options.SECTIONS and cls is tg.GuardConfig:
            continue
        name = f"{prefix}{field.name}"
        shown = f"`{name}`"
        if name in keywords:
            shown = f"`{keywords[name]}` (**keyword**; `{name}`)"
        text = docs.get(field.name, "").replace("|", "\\|")
        rows.append(f"| {shown} | {_default(field)} | {text} |")
    return rows


def render() -> str:
    lines = [HEAD, "## GuardConfig", "", *_table(tg.GuardConfig, "")]
    for name, cls in options.SECTIONS.items():
        doc = " ".join((cls.__doc__ or "").split())
        lines += ["", f"## `{name}`: `tg.{cls.__name__}`", "", doc, "", *_table(cls, f"{name}.")]
    lines += ["", "## No longer options", "", "| option | now |", "|---|---|"]
    lines += [f"| `{name}` | {what} |" for name, what in options.DROPPED.items()]
    return "\n".join(lines) + "\n"


def test_the_options_page_is_the_code() -> None:
    assert DOC.read_text() == render(), "regenerate: python tests/unit/config/test_options_doc.py"


def test_every_option_name_is_taken_by_the_one_path() -> None:
    """Every name the page lists goes through ``GuardConfig.from_options``."""
    flat = options.flat_options(tg.GuardConfig())
    for name in options.option_names():
        if name in options.SECTIONS:
            continue
        value = flat.get(name, flat.get(".".join(options.KEYWORDS.get(name, ("", "")))))
        config = tg.GuardConfig.from_options({name: value})
        assert options.flat_options(config) == flat, name  # its default, taken as given


if __name__ == "__main__":
    DOC.write_text(render())
    sys.stdout.write(f"wrote {DOC}\n")
