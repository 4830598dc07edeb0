"""Property-based bad-input tests: generated invalid configs and flag values for elastic-launch, diag, chaos.

Every generated input must give exactly one line on stderr that names the field
path or flag, a non-zero exit code, and never a traceback.  The CLIs run
in-process (their ``main(argv)``); launching is replaced by a guard that fails
the test, so an input the CLI wrongly accepts shows up as a failure, never as a
real run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import itertools
import types
import typing
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elastic.common.config import from_dict, to_dict
from elastic.run import workloads
from elastic.run.schema import DEFAULT_WORKLOAD, RunConfig

SETTINGS = settings(max_examples=30, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])

_TEXT = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=12)
_counter = itertools.count()


# -- the schema, walked once ---------------------------------------------------------------------

def _walk(cls: type, prefix: str = "") -> tuple[list[tuple[str, Any]], list[str]]:
    """(leaf fields with their types, section paths) of a config dataclass."""
    leaves, sections = [], [prefix] if prefix else []
    for name, tp in get_type_hints(cls).items():
        if get_origin(tp) is typing.ClassVar:  # a class constant (e.g. checkpoint_neutral_fields), not a field
            continue
        path = f"{prefix}.{name}" if prefix else name
        if path == "trainer":  # the default workload's section (the run schema leaves it to the workload)
            tp = workloads.get(DEFAULT_WORKLOAD).config_class
        if dataclasses.is_dataclass(tp):
            sub_leaves, sub_sections = _walk(tp, path)
            leaves += sub_leaves
            sections += sub_sections
        elif path != "fingerprint" and tp is not Any:  # ``trainer``: the workload's own schema, typed elsewhere
            leaves.append((path, tp))
    return leaves, sections


LEAVES, SECTIONS = _walk(RunConfig)
_NUMERIC = [(p, t) for p, t in LEAVES if t in (int, float)]


def _with(data: dict, path: str, value: Any) -> dict:
    data = to_dict(from_dict(RunConfig, data)) if data else to_dict(RunConfig())
    node = data
    *parents, leaf = path.split(".")
    for part in parents:
        node = node[part]
    node[leaf] = value
    return data


def _rejects(path: str, value: Any) -> bool:
    try:
        from_dict(RunConfig, _with({}, path, value))
    except ValueError:
        return True
    return False


# Numeric fields with a lower bound: the ones the schema refuses at a large negative value.
RANGED = [(p, t) for p, t in _NUMERIC if _rejects(p, -10**6)]


def _wrong_type(tp: Any) -> st.SearchStrategy:
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        (tp,) = [a for a in get_args(tp) if a is not type(None)]
        origin = get_origin(tp)
    lists = st.lists(st.integers(), min_size=1, max_size=3)
    maps = st.dictionaries(st.sampled_from(["a", "b"]), st.integers(), min_size=1, max_size=2)
    if tp is bool:
        return st.integers() | _TEXT | lists
    if tp is int:
        return _TEXT | st.booleans() | st.floats(allow_nan=False).filter(lambda f: not f.is_integer()) | lists
    if tp is float:
        return _TEXT | st.booleans() | lists | maps
    if tp is str:
        return st.integers() | st.booleans() | st.floats(allow_nan=False, allow_infinity=False) | lists | maps
    if origin is typing.Literal:
        return _TEXT.filter(lambda s: s not in get_args(tp)) | st.integers()
    if origin is list:
        return _TEXT | st.integers() | maps | st.lists(st.integers(), min_size=1, max_size=2)
    if origin is dict:
        return _TEXT | st.integers() | lists
    raise AssertionError(f"no wrong-type strategy for {tp!r}")


# -- running a CLI in-process ----------------------------------------------------------------------

@pytest.fixture(autouse=True)
def _no_real_launch(monkeypatch):
    """An input that gets past validation would start a real run: make that a test failure instead."""
    import launch.local

    class _Refuse:
        def __init__(self, *args, **kwargs) -> None:
            raise AssertionError("the CLI accepted an invalid input and tried to launch")

    monkeypatch.setattr(launch.local, "Launcher", _Refuse)
    monkeypatch.setattr("chaos.suite.run_suite", _Refuse)


def _run(main, argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            rc = main(argv)
        except SystemExit as exc:  # argparse
            rc = exc.code
    return rc, err.getvalue()


def _assert_one_line(rc: int, stderr: str, prog: str, *names: str) -> None:
    assert rc not in (0, None), f"accepted: {stderr!r}"
    lines = stderr.strip("\n").split("\n")
    assert len(lines) == 1, f"expected one line, got: {stderr!r}"
    assert "Traceback" not in stderr
    assert lines[0].startswith((f"{prog}: ", f"{prog} ")), lines[0]
    assert any(name in lines[0] for name in names), f"{names} not named in: {lines[0]!r}"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("props")


def _write_yaml(workdir: Path, data: Any) -> str:
    path = workdir / f"cfg-{next(_counter)}.yaml"
    path.write_text(yaml.safe_dump(data, allow_unicode=True))
    return str(path)


def _launch_main(argv: list[str]) -> tuple[int, str]:
    from launch.cli import main

    return _run(main, argv)


# -- configs ----------------------------------------------------------------------------------------

@SETTINGS
@given(st.data())
def test_config_with_a_wrong_type_names_the_field(workdir, data):
    path, tp = data.draw(st.sampled_from(LEAVES), label="field")
    value = data.draw(_wrong_type(tp), label="value")
    rc, err = _launch_main([_write_yaml(workdir, _with({}, path, value))])
    _assert_one_line(rc, err, "elastic-launch", path)
    assert rc == 2


@SETTINGS
@given(st.data())
def test_config_with_an_unknown_key_names_it(workdir, data):
    section = data.draw(st.sampled_from(["", *SECTIONS]), label="section")
    key = data.draw(_TEXT.filter(lambda k: k.strip() and "." not in k), label="key")
    cfg = to_dict(RunConfig())
    node = cfg
    for part in filter(None, section.split(".")):
        node = node[part]
    if key in node:
        key += "_zz"
    node[key] = 1
    rc, err = _launch_main([_write_yaml(workdir, cfg)])
    _assert_one_line(rc, err, "elastic-launch", "unknown key")
    assert (f"{section}." if section else "") in err and rc == 2


@SETTINGS
@given(st.data())
def test_config_out_of_range_names_the_field(workdir, data):
    path, tp = data.draw(st.sampled_from(RANGED), label="field")
    value = data.draw(st.integers(max_value=-(10**6)) if tp is int else st.floats(max_value=-1e6), label="value")
    rc, err = _launch_main([_write_yaml(workdir, _with({}, path, value))])
    _assert_one_line(rc, err, "elastic-launch", path)
    assert rc == 2


@SETTINGS
@given(st.data())
def test_set_flag_with_a_wrong_type_names_the_field(data):
    path, tp = data.draw(st.sampled_from(LEAVES), label="field")
    value = data.draw(_wrong_type(tp), label="value")
    rc, err = _launch_main(["--set", f"{path}={yaml.safe_dump(value, default_flow_style=True).strip()}"])
    _assert_one_line(rc, err, "elastic-launch", path, "--set")


def test_yaml_that_does_not_parse_is_one_line(workdir):
    path = workdir / "broken.yaml"
    path.write_text("run: {id: [unclosed\n")
    _assert_one_line(*_launch_main([str(path)]), "elastic-launch", "invalid YAML")


# -- elastic-launch flags ---------------------------------------------------------------------------

_not_int = _TEXT.filter(lambda s: not s.strip().lstrip("+-").isdigit())
LAUNCH_FLAGS = {
    "--nodes": _TEXT.filter(lambda s: not s.strip().isdigit()) | st.just("0") | st.just("3:2"),
    "--nproc-per-node": _not_int | st.integers(max_value=0).map(str),
    "--max-restarts": _not_int | st.integers(max_value=-1).map(str),
    "--steps": _not_int | st.integers(max_value=0).map(str),
    "--run-id": _TEXT.filter(lambda s: not s[:1].isalnum() or not s.isascii() or " " in s),
    "--etcd-endpoint": st.sampled_from([":2379", "host:abc", "host:0", "host:70000", "http://:1"]),
    "--etcd-ca": st.just("/nonexistent/ca.pem"),
    "--etcd-cert": st.just("/nonexistent/client.pem"),
    # (an empty value is the default, "not set", and valid)
    "--etcd-password-env": _TEXT.filter(lambda s: s != "" and (not s.isidentifier() or not s.isascii())),
    "--run-token-env": _TEXT.filter(lambda s: s != "" and (not s.isidentifier() or not s.isascii())),
    "--run-token-file": st.just("/nonexistent/token"),
}


@SETTINGS
@given(st.data())
def test_launch_flag_with_an_invalid_value_names_the_flag(data):
    flag = data.draw(st.sampled_from(sorted(LAUNCH_FLAGS)), label="flag")
    value = data.draw(LAUNCH_FLAGS[flag], label="value")
    extra = ["--etcd-endpoint", "127.0.0.1:1"] if flag.startswith(("--etcd-c", "--run-token")) else []
    rc, err = _launch_main([*extra, f"{flag}={value}"])
    field = {"--etcd-endpoint": "launch.etcd_endpoint"}.get(flag, flag)
    _assert_one_line(rc, err, "elastic-launch", flag, field)


@pytest.mark.parametrize("argv, named", [
    (["--etcd-endpoint", "127.0.0.1:1", "--etcd-user", "u"], "--etcd-user: needs password_env"),
    (["--etcd-user", "u", "--etcd-password-env", "SOME_UNSET_VAR_X", "--etcd-endpoint", "127.0.0.1:1"],
     "etcd.password_env"),
    (["--etcd-ca", __file__], "etcd: TLS / auth settings need launch.etcd_endpoint"),
    (["--run-token-env", "SOME_UNSET_TOKEN_X", "--etcd-endpoint", "127.0.0.1:1"], "security.token_env"),
    (["--bogus-flag"], "--bogus-flag"),
])
def test_launch_security_flag_combinations(argv, named):
    _assert_one_line(*_launch_main(argv), "elastic-launch", named)


def test_launch_half_given_cert_pair_names_the_missing_flag(tmp_path):
    cert = tmp_path / "c.pem"
    cert.write_text("x")
    rc, err = _launch_main(["--etcd-endpoint", "127.0.0.1:1", "--etcd-cert", str(cert)])
    _assert_one_line(rc, err, "elastic-launch", "etcd.key_file")


# -- diag and chaos flags -----------------------------------------------------------------------------

DIAG_CASES = st.one_of(
    st.tuples(st.just("--checks"), _TEXT.filter(lambda s: s.strip(", ") != "").map(lambda s: f"zz{s}")),
    st.tuples(st.just("--config"), st.just("/nonexistent/thresholds.yaml")),
    st.tuples(st.just("--inject"), st.just("/nonexistent/inject.yaml")),
    st.tuples(st.just("--etcd-endpoint"), st.sampled_from([":1", "h:x", "h:0", "h:99999"])),
    st.tuples(st.just("--json"), st.just("")),
)


@SETTINGS
@given(DIAG_CASES)
def test_diag_flag_with_an_invalid_value_names_the_flag(case):
    from diagnostics.cli import main

    flag, value = case
    if flag == "--json":  # a flag without its value
        rc, err = _run(main, ["burnin", "--quick", flag])
    else:
        rc, err = _run(main, ["burnin", "--quick", f"{flag}={value}"])
    _assert_one_line(rc, err, "diag", flag)
    assert rc == 2


@SETTINGS
@given(st.text(alphabet="abcdefghijklmnopqrstuvwxyz-", min_size=1, max_size=10).filter(lambda s: s[0] != "-"))
def test_diag_unknown_command_is_one_line(command):
    from diagnostics import checks as registry
    from diagnostics.cli import main

    if command in registry.REGISTRY or command in registry.ALIASES or command in ("burnin", "list"):
        command += "zz"
    rc, err = _run(main, [command])
    _assert_one_line(rc, err, "diag", repr(command), command)


_bad_seconds = st.sampled_from(["0", "-1", "nan", "inf", "-inf", "abc", ""]) | st.floats(max_value=0).map(repr)
CHAOS_CASES = st.one_of(
    st.tuples(st.just("--nodes"), (st.integers(max_value=1).map(str) | _not_int)),
    st.tuples(st.just("--jobs"), (st.integers(max_value=0).map(str) | _not_int)),
    st.tuples(st.just("--steps"), (st.integers(max_value=0).map(str) | _not_int)),
    st.tuples(st.just("--timeout-s"), _bad_seconds),
)


@SETTINGS
@given(CHAOS_CASES)
def test_chaos_suite_flag_with_an_invalid_value_names_the_flag(case):
    from chaos.cli import main

    flag, value = case
    rc, err = _run(main, ["suite", f"{flag}={value}"])
    _assert_one_line(rc, err, "chaos", flag)


@SETTINGS
@given(_bad_seconds)
def test_chaos_run_bad_timeout_or_missing_plan(value):
    from chaos.cli import main

    rc, err = _run(main, ["run", "/nonexistent/plan.yaml", f"--timeout-s={value}", "--", "elastic-launch"])
    _assert_one_line(rc, err, "chaos", "--timeout-s")
    rc, err = _run(main, ["run", "/nonexistent/plan.yaml", "--", "elastic-launch"])
    _assert_one_line(rc, err, "chaos", "plan")
