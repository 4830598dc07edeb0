"""The config reference, generated from the run config's dataclasses.

    python -m launch.config_docs > docs/config.md

Walks :class:`elastic.run.schema.RunConfig` section by section, and the ``trainer`` section of
every registered workload (entry-point group ``elastic.workloads``), and writes one row per
field: its dotted path (what ``--set PATH=VALUE`` and the YAML file take), type, default, the
``elastic-launch`` flag that sets it where there is one, and its meaning.  The meaning is the
string literal under the field in its class (the attribute docstring every config class
carries), read from the class source with :mod:`ast`; a nested section without one of its own
is described by its class docstring.  ``tests/test_config_docs.py`` fails when a field has no
description or when ``docs/config.md`` differs from what this prints.

It lives in ``launch`` because it reads the launcher's flags (:func:`launch.cli.field_flags`)
as well as the runtime's schema, which ``elastic`` may not import.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import re
import sys
import textwrap
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from typing import Any, get_args, get_origin, get_type_hints

from elastic.run import workloads
from elastic.run.schema import RunConfig
from launch.cli import field_flags


@dataclass(frozen=True)
class Field:
    path: str
    """Dotted path from the top of the run file, e.g. ``agent.inprocess.join_timeout_s``."""
    type: str
    default: str
    """The default as it would be written in YAML; empty for a section."""
    doc: str
    flag: str = ""
    section: bool = False
    """A nested dataclass: a heading, its fields follow."""


@cache
def attribute_docs(cls: type) -> dict[str, str]:
    """Field name -> the string literal right under it in ``cls`` or the dataclass it inherits from."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass is object or not dataclasses.is_dataclass(klass):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        body = tree.body[0].body  # type: ignore[attr-defined]
        for stmt, after in zip(body, body[1:]):
            if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                    and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                    and isinstance(after.value.value, str)):
                docs[stmt.target.id] = inspect.cleandoc(after.value.value)
    return docs


def type_name(tp: Any) -> str:
    """A field type as the reference writes it: ``float``, ``str | null``, ``"flag" | "exclude"``."""
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(arg) for arg in get_args(tp))
    if origin is typing.Literal:
        return " | ".join(json.dumps(choice) for choice in get_args(tp))
    if origin is list:
        return f"list[{type_name(get_args(tp)[0])}]"
    if origin is dict:
        key, value = get_args(tp)
        return f"dict[{type_name(key)}, {type_name(value)}]"
    if tp is type(None):
        return "null"
    if tp is Any:
        return "any"
    return getattr(tp, "__name__", str(tp))


def _default(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return "(required)"
    return json.dumps(value)


def walk(cls: type, prefix: str, flags: dict[str, str]) -> Iterator[Field]:
    """Every field of dataclass ``cls`` under ``prefix``, depth first; a section before its fields."""
    hints = get_type_hints(cls)
    docs = attribute_docs(cls)
    for field in dataclasses.fields(cls):
        if not field.init:
            continue
        path = f"{prefix}.{field.name}" if prefix else field.name
        tp = hints[field.name]
        if dataclasses.is_dataclass(tp):
            doc = docs.get(field.name) or inspect.cleandoc(tp.__doc__ or "")
            if doc.startswith(f"{tp.__name__}("):  # dataclass's generated signature, not a description
                doc = ""
            yield Field(path=path, type=tp.__name__, default="", doc=doc, section=True)
            yield from walk(tp, path, flags)
        elif path == "trainer":
            continue  # the workload's section: one per registered workload, see fields()
        else:
            yield Field(path=path, type=type_name(tp), default=_default(field), doc=docs.get(field.name, ""),
                        flag=flags.get(path, ""))


def sections() -> list[tuple[str, str, list[Field]]]:
    """(heading, intro, fields) per top-level part of the run file; ``trainer`` once per workload."""
    flags = field_flags()
    groups: dict[str, list[Field]] = {}
    for f in walk(RunConfig, "", flags):
        groups.setdefault(f.path.split(".")[0], []).append(f)
    out: list[tuple[str, str, list[Field]]] = []
    for name, group in groups.items():
        if group[0].section and group[0].path == name:
            out.append((name, group[0].doc, group[1:]))
        else:
            out.append((name, "", group))
        if name == "security":  # the trainer section sits where RunConfig declares it
            for workload in sorted(workloads.available().values(), key=lambda w: w.name):
                cls = workload.config_class
                intro = (f"`launch.workload: {workload.name}`: {workload.description}. "
                         f"Config class `{cls.__module__}.{cls.__name__}`.")
                neutral = sorted(getattr(cls, "checkpoint_neutral_fields", ()))
                if neutral:
                    intro += (" Outside the checkpoint fingerprint (a run changed only in these resumes its "
                              "checkpoints): " + ", ".join(f"`trainer.{path}`" for path in neutral) + ".")
                out.append((f"trainer (workload {workload.name})", intro, list(walk(cls, "trainer", flags))))
    return out


def fields() -> list[Field]:
    """Every field of the reference, sections included, in its order."""
    return [f for _, _, group in sections() for f in group]


_CODE_SPAN = re.compile(r"(``.+?``|`[^`]+`)")


def _cell(text: str) -> str:
    """One table cell: one line, ``|`` escaped, ``<`` and ``>`` outside code spans as entities."""
    parts = _CODE_SPAN.split(" ".join(text.split()))
    for i in range(0, len(parts), 2):
        parts[i] = parts[i].replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return "".join(parts).replace("|", "\\|")


def render() -> str:
    lines = [
        "# Config reference",
        "",
        "<!-- Generated by `python -m launch.config_docs > docs/config.md` from the config dataclasses;",
        "     tests/test_config_docs.py fails when this file is stale.  Edit the field docstrings, not this file. -->",
        "",
        "Every field of the run file, by its dotted path. A YAML file nests the path's parts",
        "(`agent: {inprocess: {join_timeout_s: 30}}`); `elastic-launch --set PATH=VALUE` sets any field",
        "(the value is parsed as YAML), and the flags listed override the file too. Precedence, lowest first:",
        "the defaults below, the file, the flags and `--set`. Unknown keys and bad values are refused with one",
        "line naming the field (exit 2). How the file, the flags and `--fresh` work together:",
        "[operations](operations.md#config).",
        "",
        "The `trainer` section belongs to the workload (`launch.workload`); the built-in ones are listed.",
        "A custom `launch.entrypoint` gets its `trainer` section passed through unread.",
        "",
    ]
    for heading, intro, group in sections():
        lines += [f"## {heading}", ""]
        if intro:
            lines += [_cell(intro), ""]
        lines += ["| path | type | default | flag | meaning |", "|---|---|---|---|---|"]
        for f in group:
            if f.section:
                lines.append(f"| **`{f.path}`** | section | | | {_cell(f.doc)} |")
            else:
                flag = f"`{f.flag}`" if f.flag else ""
                lines.append(f"| `{f.path}` | `{_cell(f.type)}` | `{_cell(f.default)}` | {flag} | {_cell(f.doc)} |")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
