"""The config reference (docs/config.md): every field described, and the page as generated now."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from elastic.common.config import to_dict
from elastic.run import workloads
from elastic.run.schema import RunConfig
from launch.cli import build_parser, field_flags
from launch.config_docs import attribute_docs, fields, render

REPO = Path(__file__).resolve().parents[1]
REGENERATE = "python -m launch.config_docs > docs/config.md"


def test_every_config_field_has_a_description():
    missing = [f.path for f in fields() if not f.doc.strip()]
    assert not missing, (f"{len(missing)} config fields have no description (a string literal under the field, "
                         f"or a class docstring for a section): " + ", ".join(missing))


def test_the_reference_is_what_the_generator_prints_now():
    page = (REPO / "docs" / "config.md").read_text()
    assert page == render(), f"docs/config.md is stale: run `{REGENERATE}` and commit it"


def _leaf_paths(tree: dict, prefix: str = "") -> set[str]:
    out = set()
    for key, value in tree.items():
        path = f"{prefix}.{key}" if prefix else key
        out |= _leaf_paths(value, path) if isinstance(value, dict) and value else {path}
    return out


def test_the_reference_lists_every_field_of_every_section_and_workload():
    listed = {f.path for f in fields() if not f.section}
    defaults = to_dict(RunConfig())
    defaults.pop("trainer")
    expected = _leaf_paths(defaults) | {"agent.failure.actions"}  # an empty mapping is a leaf, not a section
    for workload in workloads.available().values():
        expected |= {f"trainer.{p}" for p in _leaf_paths(to_dict(workload.config_class()))}
    assert expected - listed == set() and listed - expected == set()


def test_every_flag_it_names_sets_a_field_it_lists():
    listed = {f.path for f in fields() if not f.section}
    assert set(field_flags()) <= listed
    parser_flags = {opt for action in build_parser()._actions for opt in action.option_strings}
    assert set(field_flags().values()) <= parser_flags


def test_docstrings_are_read_from_the_class_source():
    @dataclasses.dataclass
    class Example:
        a: int = 1
        """The a."""
        b: int = 2
        c: int = 3
        """The c,
        on two lines."""

    assert attribute_docs(Example) == {"a": "The a.", "c": "The c,\non two lines."}
