"""The docs' local commands, run as written (slow tier): the README's tour and the replica examples.

Each test takes the shell block from the doc itself and runs it with bash in a fresh directory
that has the repository's ``examples/`` (the commands use relative paths, as a reader's checkout
does), so a change to a documented command is a change to what runs here.
tests/test_docs_commands.py lists these tests as the ones covering those commands.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.launch_helpers import wait_for_event
from tests.test_docs_commands import blocks

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]


def _block(doc: str, command: str) -> str:
    """The text of the first bash block of ``doc`` that has ``command`` as one of its commands."""
    found = next(b for b in blocks(REPO / doc) if b.lang == "bash" and command in b.commands())
    return "\n".join(found.body)


def _checkout(tmp_path: Path) -> Path:
    (tmp_path / "examples").symlink_to(REPO / "examples")
    return tmp_path


@pytest.mark.timeout(420)
def test_the_tour_runs_as_written(tmp_path, subprocess_env):
    cwd = _checkout(tmp_path)
    launch = _block("README.md", "elastic-launch --nodes 4 examples/tiny.yaml")
    status = _block("README.md", 'elastic status --etcd "$ETCD" --run-id tiny')
    proc = subprocess.Popen(["bash", "-ec", launch], cwd=cwd, env=subprocess_env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        # Step 2 of the tour runs while the run does (its etcd lives only as long as the launch).
        wait_for_event(cwd / "runs" / "tiny", lambda e: e["kind"] == "trainer.step", timeout=240, proc=proc)
        shown = subprocess.run(["bash", "-ec", status], cwd=cwd, env=subprocess_env, capture_output=True,
                               text=True, timeout=60)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert shown.returncode == 0, shown.stdout + shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[0].startswith("run tiny, epoch "), shown.stdout
    assert {line.split()[0] for line in lines[2:6]} == {"node0", "node1", "node2", "node3"}, shown.stdout
    assert proc.returncode == 0, out
    assert "run tiny: 40/40 steps" in out and "nodes: node0=rc0, node1=rc0, node2=rc0, node3=rc0" in out, out


# Soak tier (pytest -m soak), kept out of the default suite's 30 minutes: replica groups end to end stay in the default suite through test_dit_replicas.py.
@pytest.mark.soak
@pytest.mark.timeout(600)
def test_the_replica_examples_run(tmp_path, subprocess_env):
    cwd = _checkout(tmp_path)
    script = _block("docs/architecture.md", "elastic-launch examples/mlp-replicas.yaml")
    assert "elastic-launch examples/dit-replicas.yaml" in script  # both examples, one after the other
    proc = subprocess.run(["bash", "-ec", script], cwd=cwd, env=subprocess_env, capture_output=True, text=True,
                          timeout=540)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for run, groups in (("mlp-replicas", 2), ("dit-replicas", 3)):
        summary = json.loads((cwd / "runs" / run / "summary.json").read_text())
        assert summary["nodes"] == {f"node{i}": 0 for i in range(groups)}, (run, summary)
        checksums = {p.read_text().strip() for p in (cwd / "runs" / run).glob("final_checksum-*.txt")}
        assert len(checksums) == 1, (run, checksums)  # every group ended with the same weights
