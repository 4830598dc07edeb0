"""The spare zygote (elastic.worker.zygote, elastic.agent.sparefork) with real processes.

Each case runs in a child process that makes itself a child subreaper, as the agent does (the
test process must not become one: it would adopt every orphan of the other tests)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

_PRELUDE = """
import json, os, signal, sys, time
from pathlib import Path
from elastic.common.procs import become_subreaper
from elastic.agent.sparefork import SpareFactory
assert become_subreaper()
out = Path(sys.argv[1])

def started(module):
    factory = SpareFactory(["-m", module], {**os.environ, "OMP_NUM_THREADS": "1"}, out)
    deadline = time.monotonic() + 90
    while factory.state == "importing" and time.monotonic() < deadline:
        factory.ready()
        time.sleep(0.02)
    return factory
"""


def _drive(tmp_path: Path, body: str, env: dict[str, str]) -> dict:
    script = _PRELUDE + textwrap.dedent(body)
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], env=env, capture_output=True,
                          text=True, timeout=110)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_forked_spares_are_the_agents_children_with_their_own_stdin_and_log(tmp_path, subprocess_env):
    result = _drive(tmp_path, """
        factory = started("tests.zygote_main")
        spares = [factory.fork({"PATH": os.environ["PATH"], "MARK": str(i)}, out / f"s{i}.log") for i in range(3)]
        parents = [int(open(f"/proc/{s.pid}/status").read().split("PPid:")[1].split()[0]) for s in spares]
        for i in (0, 1):  # a slot for each: the trainer's main runs with both environments
            spares[i].stdin.write((json.dumps({"slot": 0, "env": {"SLOT": f"s{i}"}}) + "\\n").encode())
            spares[i].stdin.flush()
        spares[2].kill()
        codes = [s.wait(30) for s in spares]
        lines = [[json.loads(l) for l in (out / f"s{i}.log").read_text().splitlines()] for i in (0, 1)]
        factory.close()
        print(json.dumps({"zygote": factory.pid, "me": os.getpid(), "parents": parents, "codes": codes,
                          "lines": lines}))
    """, subprocess_env)
    assert result["parents"] == [result["me"]] * 3  # re-parented to the subreaper, not the zygote's
    assert result["codes"] == [0, 0, -9]  # waitpid in the "agent" read all three
    for i, lines in enumerate(result["lines"]):
        assert lines[0]["spare"] == "ready" and lines[0]["forked_from"] == result["zygote"]
        assert {"main": [], "mark": str(i), "slot": f"s{i}"} in lines  # its own environment, then its slot's


def test_a_zygote_with_a_second_thread_never_forks(tmp_path, subprocess_env):
    result = _drive(tmp_path, """
        factory = started("tests.zygote_threaded")
        spare = factory.fork({}, out / "s.log")
        factory.close()
        print(json.dumps({"state": factory.state, "hello": factory.hello, "spare": spare is not None}))
    """, subprocess_env)
    assert result["state"] == "unforkable" and result["hello"]["threads"] > 1 and not result["spare"]


def test_a_dead_zygote_gives_no_spare_and_says_why(tmp_path, subprocess_env):
    result = _drive(tmp_path, """
        factory = started("json")
        factory.proc.kill()
        factory.proc.wait()
        spare = factory.fork({}, out / "s.log")
        print(json.dumps({"state": factory.state, "error": factory.error, "spare": spare is not None}))
    """, subprocess_env)
    assert result == {"state": "gone", "error": "the zygote exited -9", "spare": False}
