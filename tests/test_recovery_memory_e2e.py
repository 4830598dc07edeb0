"""Memory while re-forming: a survivor's peak RSS over its recovery against its steady state.

A recovery rebuilds the trainer and restores its state while the old world's objects may still be
alive; on a GPU the same transient decides whether the new world fits. The 4-node DiT loses a
node (3:4, so the survivors reshard from the buddy's memory); every survivor's ``trainer.recovered``
carries ``peak_rss_ratio`` (the recovery's peak over the last steps' peak, from ``VmHWM``), which
must stay at or under 1.3.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.launch_helpers import kill_node
from tests.test_inprocess_e2e import _after_retire, _assert_in_process, _dit_config, _run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_a_resharding_survivors_peak_memory_stays_within_1_3x_its_steady_state(tmp_path, subprocess_env):
    config = _dit_config(tmp_path, "mem", "3:4", 1, cp=1)

    def act(run_dir: Path, proc) -> float:
        _after_retire(run_dir, proc, "node3", min_step=10)
        return kill_node(run_dir, "node3")

    summary, events, kill_ts = _run(config, subprocess_env, act)
    _assert_in_process(events, kill_ts)
    recovered = [e for e in events if e["kind"] == "trainer.recovered" and e["ts"] > kill_ts]
    assert len(recovered) == 3 and {e["world_size"] for e in recovered} == {3}
    ratios = [e["peak_rss_ratio"] for e in recovered]
    assert all(r is not None and r <= 1.3 for r in ratios), [(e["rank"], e["peak_rss_mb"], e["steady_rss_mb"])
                                                               for e in recovered]
    assert summary["last_step"] == 40
