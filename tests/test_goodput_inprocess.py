"""Goodput of runs that recover in-process: the survivors re-form in their own processes and a warm
spare takes the dead slot, so rank 0 starts no new trainer; the time from the last step before the
fault to the first step after it is recovery, once per gap however many faults share it, and the
parts still add up to the wall time.  Synthetic event lists shaped like a real 4-node DiT run's
(two workers SIGKILLed at once after step 15: before this accounting it read "recovery 0.0s,
other 7.9s")."""

from __future__ import annotations

import random

import pytest

from chaos.soak import PARTS, goodput_invariant
from elastic.run.goodput import compute_goodput


def _ev(kind: str, ts: float, source: str = "trainer/rank0", **fields) -> dict:
    return {"kind": kind, "ts": ts, "source": source, **fields}


def _steps(first_end: float, steps: range, step_time: float = 0.2, source: str = "trainer/rank0") -> list[dict]:
    return [_ev("trainer.step", first_end + i * step_time, source, step=s, step_time=step_time)
            for i, s in enumerate(steps)]


def _worker_killed(node: str, ts: float, gen: int = 1) -> list[dict]:
    """What the killed worker's agent says: the fault, and the spare it puts in the dead slot."""
    source = f"agent/{node}"
    return [_ev("run.fault", ts, source, node=node, failure_kind="worker_signal"),
            _ev("agent.restart", ts, source, reason="worker_signal", action="replace", path="inprocess",
                fault=f"{node}/e0-a1-1"),
            _ev("agent.inprocess_replace", ts, source, local_rank=0, gen=gen)]


def _assert_partition(g: dict) -> None:
    assert all(g[p] >= 0 for p in PARTS), g
    assert sum(g[p] for p in PARTS) == pytest.approx(g["wall_s"], abs=0.01), g
    assert goodput_invariant(g).ok


def _two_simultaneous_kills() -> list[dict]:
    """Steps 1..15 end at 11.0..13.8; node1's and node2's workers die at 14.0 (during step 16); rank 0
    re-forms and restores step 15 by 19.0; steps 16..40 follow; the run ends at 24.5."""
    ev = [_ev("launcher.start", 0.0, "launcher"), _ev("trainer.start", 10.0, step=0)]
    ev += _steps(11.0, range(1, 16))
    ev += [_ev("trainer.peer_lost", 14.1, step=16, gen=0), _ev("trainer.peer_lost", 14.1, "trainer/rank3", step=16)]
    ev += _worker_killed("node1", 14.2) + _worker_killed("node2", 14.2)
    ev += [_ev("trainer.start", 18.9, "trainer/rank1", step=15, resumed=True, gen=1),
           _ev("trainer.recovered", 19.0, step=15, gen=1, path="inprocess"),
           _ev("trainer.recovered", 19.0, "trainer/rank3", step=15, gen=1, path="inprocess")]
    ev += _steps(19.2, range(16, 41))  # step 16 begins at 19.0
    ev += [_ev("trainer.done", 24.2, step=40), _ev("launcher.etcd_stopped", 24.5, "launcher")]
    return ev


def test_two_simultaneous_worker_kills_are_one_recovery_from_the_last_step_to_the_first_after():
    g = compute_goodput(_two_simultaneous_kills())
    assert g["recovery_s"] == pytest.approx(19.0 - 13.8)  # last step before the kills -> step 16 begins
    assert g["other_s"] == pytest.approx(24.5 - 24.0)  # the shutdown after step 40 only
    assert g["productive_s"] == pytest.approx(40 * 0.2) and g["startup_s"] == pytest.approx(10.8)
    assert g["inprocess_recoveries"] == 1 and g["restarts"] == 0 and g["steps_redone"] == 0
    _assert_partition(g)


def test_a_chaos_harness_bookkeeping_after_the_run_is_not_the_runs_wall_time():
    """A soak's harness reads etcd and writes its verdicts once the nodes are gone (2.8-3.8 s in a
    10-minute soak): that was "other" in the soak and in its replay alike.  Its events during the run
    still count (the run's wall begins at the launcher either way)."""
    ev = _two_simultaneous_kills() + [_ev("chaos.inject", 14.0, "chaos", fault="kill_worker")]
    tail = [_ev("chaos.exclusions", 27.3, "chaos", nodes=[]), _ev("chaos.end", 27.4, "chaos", rc=0)]
    g, with_tail = compute_goodput(ev), compute_goodput(ev + tail)
    assert with_tail == g and g["wall_s"] == pytest.approx(24.5)
    _assert_partition(with_tail)


def test_a_kill_of_rank_0_is_recovered_by_the_spare_that_took_its_slot():
    ev = [_ev("launcher.start", 0.0, "launcher"), _ev("trainer.start", 1.0, step=0)]
    ev += _steps(1.2, range(1, 11))  # end 1.2..3.0
    ev += _worker_killed("node0", 3.1)
    ev += [_ev("trainer.peer_lost", 3.1, "trainer/rank1", step=11),
           _ev("trainer.start", 5.0, step=10, resumed=True, gen=1, loaded_from="agent memory"),
           _ev("trainer.recovered", 5.0, step=10, gen=1, path="inprocess")]
    ev += _steps(5.2, range(11, 21))  # step 11 begins at 5.0
    g = compute_goodput(ev)
    assert g["recovery_s"] == pytest.approx(5.0 - 3.0)
    assert g["restarts"] == 0 and g["inprocess_recoveries"] == 1  # a spare joining is not a restart
    _assert_partition(g)


def test_a_second_kill_during_the_recovery_shares_its_gap_and_a_save_in_it_is_not_counted_twice():
    ev = [_ev("launcher.start", 0.0, "launcher"), _ev("trainer.start", 1.0, step=0)]
    ev += _steps(1.2, range(1, 11))  # end 1.2..3.0
    ev += [_ev("checkpoint.save_start", 3.0, step=10), _ev("checkpoint.staged", 3.1, step=10, blocking_s=0.1)]
    ev += [_ev("trainer.peer_lost", 3.05, step=11, gen=0),  # the kill cut the save's staging
           _ev("trainer.recovered", 4.0, step=10, gen=1, path="inprocess"),
           _ev("trainer.peer_lost", 4.1, step=11, gen=1),  # a second kill before any step
           _ev("trainer.recovered", 6.0, step=10, gen=2, path="inprocess")]
    ev += _steps(6.2, range(11, 21))  # step 11 begins at 6.0
    g = compute_goodput(ev)
    assert g["recovery_s"] == pytest.approx(6.0 - 3.0) and g["checkpoint_s"] == 0.0
    assert g["inprocess_recoveries"] == 2 and g["restarts"] == 0
    _assert_partition(g)


def test_an_in_process_recovery_that_fell_back_to_a_restart_is_one_gap_and_counts_the_redone_steps():
    ev = [_ev("launcher.start", 0.0, "launcher"), _ev("trainer.start", 1.0, step=0)]
    ev += _steps(1.2, range(1, 11))  # end 1.2..3.0
    ev += [_ev("trainer.peer_lost", 3.1, step=11, gen=0),
           _ev("trainer.recovery_failed", 4.0, step=11, error="RuntimeError: both buddies lost"),
           _ev("trainer.start", 9.0, step=5, resumed=True)]  # from the disk checkpoint of step 5
    ev += _steps(10.2, range(6, 21))  # step 6 begins at 10.0
    g = compute_goodput(ev)
    assert g["recovery_s"] == pytest.approx(10.0 - 3.0)
    assert g["restarts"] == 1 and g["inprocess_recoveries"] == 0
    assert g["steps_redone"] == 5 and g["lost_s"] == pytest.approx(5 * 0.2)
    _assert_partition(g)


def test_rank_0_lost_with_its_node_the_rank_that_went_on_is_the_timeline():
    """A survivor that became rank 0 keeps its first rank's event source (trainer/rank1)."""
    ev = [_ev("launcher.start", 0.0, "launcher")]
    for rank in (0, 1):
        ev += [_ev("trainer.start", 1.0, f"trainer/rank{rank}", step=0)]
        ev += _steps(1.2, range(1, 11), source=f"trainer/rank{rank}")  # end 1.2..3.0
    ev += [_ev("run.fault", 3.2, "agent/node1", node="node0", failure_kind="node_lost"),
           _ev("trainer.peer_lost", 3.1, "trainer/rank1", step=11, gen=0),
           _ev("trainer.recovered", 4.5, "trainer/rank1", step=10, gen=1, path="inprocess", world_size=1)]
    ev += _steps(4.7, range(11, 21), source="trainer/rank1")  # step 11 begins at 4.5
    ev += [_ev("trainer.done", 6.6, "trainer/rank1", step=20)]
    g = compute_goodput(ev)
    assert g["productive_s"] == pytest.approx(20 * 0.2) and g["recovery_s"] == pytest.approx(4.5 - 3.0)
    assert g["inprocess_recoveries"] == 1
    _assert_partition(g)


def test_a_fault_after_the_last_step_that_nothing_recovered_is_recovery_until_the_agents_gave_up():
    ev = [_ev("launcher.start", 0.0, "launcher"), _ev("trainer.start", 1.0, step=0)]
    ev += _steps(1.2, range(1, 11))  # end 1.2..3.0
    ev += [_ev("trainer.peer_lost", 3.1, step=11, gen=0),
           _ev("agent.state", 8.0, "agent/node0", state="GAVE_UP", reason="node node1 lost"),
           _ev("launcher.etcd_stopped", 8.5, "launcher")]
    g = compute_goodput(ev)
    assert g["recovery_s"] == pytest.approx(8.0 - 3.0) and g["other_s"] == pytest.approx(0.5)
    _assert_partition(g)


@pytest.mark.parametrize("seed", range(20))
def test_random_fault_sequences_partition_the_wall_time(seed):
    """Restarts, in-process recoveries, kills during recoveries and saves, in random order: the parts
    add up to the wall time, none negative, and recovery is the union of the gaps."""
    rng = random.Random(seed)
    ev = [_ev("launcher.start", 0.0, "launcher"), _ev("trainer.start", 2.0, step=0)]
    t, step, gaps = 2.0, 0, 0.0
    while step < 40:
        step += 1
        t += 0.2
        ev.append(_ev("trainer.step", t, step=step, step_time=0.2))
        step_end = t
        if step % 5 == 0:
            ev += [_ev("checkpoint.save_start", t + 0.01, step=step),
                   _ev("checkpoint.staged", t + 0.06, step=step, blocking_s=0.05)]
            t += 0.06
        if step < 40 and rng.random() < 0.2:  # (after the last step: the run-gave-up test above)
            for _ in range(rng.randint(1, 3)):  # faults sharing one gap
                t += rng.uniform(0.1, 2.0)
                kind = rng.choice(["inprocess", "inprocess", "restart"])
                if kind == "inprocess":
                    ev += [_ev("trainer.peer_lost", t, step=step + 1), _ev("trainer.recovered", t + 0.5, step=step)]
                    t += 0.5
                else:
                    ev.append(_ev("trainer.start", t, step=step, resumed=True))
            gaps += t - step_end  # a save just before the faults lies in their gap
    ev.append(_ev("launcher.etcd_stopped", t + 1.0, "launcher"))
    g = compute_goodput(ev)
    assert g["recovery_s"] == pytest.approx(gaps, abs=0.002)
    _assert_partition(g)
