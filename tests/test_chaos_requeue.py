"""Which dead launchers a soak relaunches (a scheduler's requeue) and which it must leave down."""

from __future__ import annotations

import subprocess
import sys
import time

from chaos.nodes import Node, NodeSet


def _exited(code: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", f"raise SystemExit({code})"])
    proc.wait(timeout=30)
    return proc


def test_a_node_the_run_refused_is_not_requeued():
    """Soak seed 3 (2026-12-05) relaunched a node refused for its code (95) 127 times."""
    nodes = NodeSet(launch=None)  # type: ignore[arg-type]  # poll/lost/refused read only the processes
    for index, (name, code) in enumerate([("crashed", 1), ("excluded", 93), ("other-run", 94), ("other-code", 95),
                                          ("finished", 0)]):
        nodes.nodes[name] = Node(name, index, _exited(code), time.monotonic())
    assert nodes.lost() == ["crashed"]
    assert nodes.refused() == {"other-run": 94, "other-code": 95}  # excluded nodes are the exclusion's story
