"""Pieces of the suite and soak that need no training run: goodput accounting, the etcd proxy's
knobs (real sockets on loopback), the soak's plan and per-kind costs, and the HTML report in a real
headless browser."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from chaos.etcd_proxy import EtcdProxy
from chaos.html import write_soak_html, write_suite_html
from chaos.soak import PARTS, goodput_invariant, parse_duration, per_kind
from elastic.common.config import ConfigError
from elastic.run.goodput import compute_goodput


def _steps(t0: float, steps: range, step_time: float = 1.0) -> list[dict]:
    return [{"ts": t0 + i * step_time, "source": "trainer/rank0", "kind": "trainer.step", "step": s,
             "step_time": step_time} for i, s in enumerate(steps, start=1)]


def test_goodput_parts_partition_the_wall_time_with_back_to_back_restarts_and_a_save_in_the_gap():
    ev = [{"ts": 0.0, "source": "launcher", "kind": "launcher.start"},
          {"ts": 10.0, "source": "trainer/rank0", "kind": "trainer.start", "step": 0}]
    ev += _steps(10.0, range(1, 5))  # steps 1..4 end at 11..14
    ev += [{"ts": 14.1, "source": "trainer/rank0", "kind": "checkpoint.save_start", "step": 4},
           {"ts": 14.6, "source": "trainer/rank0", "kind": "checkpoint.staged", "step": 4, "blocking_s": 0.5},
           {"ts": 14.7, "source": "trainer/rank0", "kind": "checkpoint.save_start", "step": 5},  # a save the kill cut
           {"ts": 16.0, "source": "trainer/rank0", "kind": "trainer.start", "step": 4},  # restart ...
           {"ts": 19.0, "source": "trainer/rank0", "kind": "trainer.start", "step": 4}]  # ... killed again at once
    ev += _steps(20.0, range(5, 9))  # 5..8 end at 21..24
    g = compute_goodput(ev)
    assert g["recovery_s"] == 6.0  # one gap 14 -> 20, not one per restart
    assert g["checkpoint_s"] == 0.0  # the save at 14.1 lies inside that gap
    assert g["productive_s"] == 8.0 and g["startup_s"] == 10.0
    assert abs(sum(g[p] for p in PARTS) - g["wall_s"]) < 1e-6
    assert goodput_invariant(g).ok
    assert not goodput_invariant({**g, "recovery_s": g["recovery_s"] + 3}).ok


def test_soak_durations_and_per_kind_costs():
    assert parse_duration("10m", "--duration") == 600 and parse_duration("90s", "--mtbf") == 90
    assert parse_duration("1.5h", "--duration") == 5400 and parse_duration("45", "--mtbf") == 45
    with pytest.raises(ConfigError, match="--mtbf"):
        parse_duration("soon", "--mtbf")
    events = _steps(0.0, range(1, 11), 0.5) + [{"ts": 30.0, "kind": "trainer.step", "source": "trainer/rank0",
                                                   "step": 11, "step_time": 0.5}]
    metrics = [{"fault": "kill_worker", "took_effect": True, "restarted": True, "recovery_s": 8.0, "steps_lost": 2},
               {"fault": "kill_worker", "took_effect": True, "restarted": True, "recovery_s": None, "steps_lost": 0},
               {"fault": "straggler", "took_effect": True, "restarted": False, "fault_ts": 2.0, "steps_lost": 0}]
    kinds = per_kind(metrics, events, wall=100.0)
    assert kinds["kill_worker"] == {"injected": 2, "recovered": 1, "steps_lost": 2, "cost_s": 9.0,
                                    "mean_recovery_s": 8.0, "max_recovery_s": 8.0, "goodput_cost": 0.09}
    assert kinds["straggler"]["recovered"] == 1


def test_soak_figures_mttr_goodput_after_startup_and_the_hang_verdict():
    from chaos.cluster_runner import ClusterOutcome
    from chaos.soak import goodput_excl_startup, hang_invariant, mttr, percentile, summary_lines

    assert percentile([], 0.5) is None and percentile([4.0], 0.95) == 4.0
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 0.5) == 3.0 and percentile([1.0, 2.0, 3.0, 4.0, 5.0], 0.95) == 4.8
    metrics = [{"fault": "kill_worker", "restarted": True, "recovery_s": 2.0},
               {"fault": "kill_agent", "restarted": True, "recovery_s": 4.0},
               {"fault": "kill_worker", "restarted": True, "recovery_s": None},  # never recovered: no time
               {"fault": "straggler", "restarted": False, "recovery_s": None}]  # needed no recovery
    assert mttr(metrics) == {"p50": 3.0, "p95": 3.9, "n": 2}
    assert mttr([]) == {"p50": None, "p95": None, "n": 0}
    g = {"goodput": 0.5, "wall_s": 100.0, "productive_s": 50.0, "startup_s": 20.0, "recovery_s": 10.0,
         "checkpoint_s": 5.0, "lost_s": 5.0, "other_s": 10.0}
    assert goodput_excl_startup(g) == 0.625 and goodput_excl_startup({"goodput": None}) is None
    assert goodput_excl_startup({**g, "startup_s": 100.0}) is None

    done = ClusterOutcome(rc=0, run_dir=Path("."), wall_s=1.0, node_rcs={"node0": 0})
    timed_out = ClusterOutcome(rc=-15, run_dir=Path("."), wall_s=1.0, node_rcs={"node0": -15}, timed_out=True)
    lingered = ClusterOutcome(rc=0, run_dir=Path("."), wall_s=1.0, node_rcs={"node0": 0}, lingered=True)
    assert hang_invariant(300, {"soak": done, "replay": done}).ok
    assert hang_invariant(300, {"soak": done, "replay": None}).ok
    hung = hang_invariant(300, {"soak": timed_out, "replay": None})
    assert not hung.ok and hung.name == "no_hang" and "soak: still running after 300s" in hung.detail
    assert "a launcher was still running" in hang_invariant(300, {"soak": done, "replay": lingered}).detail

    report = {"goodput": g, "goodput_excl_startup": 0.625, "mttr_s": {"p50": 3.0, "p95": 3.9, "n": 2},
              "hung": True, "injected": 2, "recovered": 2, "planned": 2, "requeues": 0, "etcd_members": 3,
              "per_kind": {}, "not_drawn": ["nan"], "broken": [hung.to_json()]}
    text = "\n".join(summary_lines(report))
    assert "goodput_excl_startup 0.625" in text and "mttr_s p50 3s p95 3.9s over 2 faults" in text
    assert "hung: YES" in text and "etcd members 3" in text and "not drawn this time: nan" in text
    assert "BROKEN: no_hang: HUNG: soak: still running after 300s" in text


def test_the_fault_free_replay_is_the_soaks_baseline_and_the_difference_is_what_faults_cost(tmp_path):
    from chaos.soak import fault_free, faults_cost, summary_lines

    # The replay: launched at 0, first step begins at 10, 40 steps of 0.9 s with 0.1 s between them.
    events = [{"ts": 0.0, "source": "launcher", "kind": "launcher.start"}]
    events += [{"ts": 10.0 + i * 1.0 + 0.9, "source": "trainer/rank0", "kind": "trainer.step", "step": i + 1,
                "step_time": 0.9} for i in range(40)]
    events.append({"ts": 50.0, "source": "trainer/rank0", "kind": "trainer.done"})
    (tmp_path / "events").mkdir()
    (tmp_path / "events" / "agent-node0.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    base = fault_free(tmp_path)
    assert base["goodput_excl_startup"] == 0.9  # 36 s of steps over the 40 s after startup
    soak = {"goodput": 0.5, "wall_s": 100.0, "productive_s": 72.0, "startup_s": 10.0}
    assert faults_cost(soak, base) == 0.1  # 0.9 without faults, 0.8 with them
    assert faults_cost(soak, {}) is None and fault_free(tmp_path / "nothing") == {}
    report = {"goodput": {**soak, "recovery_s": 0, "checkpoint_s": 0, "lost_s": 0, "other_s": 18.0},
              "goodput_excl_startup": 0.8, "fault_free": base, "faults_cost_excl_startup": 0.1,
              "mttr_s": {"p50": None, "p95": None, "n": 0}, "hung": False, "injected": 0, "recovered": 0,
              "planned": 0, "requeues": 0, "per_kind": {}, "broken": []}
    text = "\n".join(summary_lines(report))
    assert "fault-free replay: goodput_excl_startup 0.9 (this job's ceiling on this host); the faults cost 0.1" in text


def test_soak_html_shows_the_hang_and_the_figures(tmp_path):
    from chaos.soak import hang_invariant

    hung = hang_invariant(300, {"soak": _outcome(timed_out=True)}).to_json()
    report = {"ok": False, "broken": [hung], "job": "tiny.yaml", "nodes": 4, "steps": 900, "injected": 1,
              "recovered": 1, "planned": 1, "mtbf_s": 60.0, "seed": 1, "duration_s": 180.0, "requeues": 0,
              "skipped_batches": [], "replay_checksum": None, "etcd_members": 3, "hung": True,
              "goodput_excl_startup": 0.953, "mttr_s": {"p50": 1.25, "p95": 2.5, "n": 3},
              "goodput": {"goodput": 0.5, "wall_s": 100.0, "productive_s": 50.0, "startup_s": 10.0,
                          "recovery_s": 20.0, "checkpoint_s": 5.0, "lost_s": 5.0, "other_s": 10.0},
              "per_kind": {}, "soak": {"result": {"faults": [], "invariants": [hung]}}}
    text = write_soak_html(report, tmp_path / "soak.html", None).read_text()
    assert "BROKEN: no_hang" in text and "YES: the run did not end on its own" in text
    assert "0.953" in text and "p50 1.25 s, p95 2.50 s over 3 faults" in text


def _outcome(**kw):
    from chaos.cluster_runner import ClusterOutcome

    return ClusterOutcome(rc=-15, run_dir=Path("."), wall_s=1.0, node_rcs={"node0": -15}, **kw)


def test_a_fault_that_restarts_nothing_does_not_own_a_later_kills_recovery():
    from chaos.analysis import fault_metrics

    events = [{"ts": 1.0, "source": "trainer/rank0", "kind": "trainer.start", "pid": 10, "step": 0}]
    events += [{**e, "pid": 10} for e in _steps(1.0, range(1, 11))]  # steps 1..10 end at 2..11
    events += [{"ts": 13.0, "source": "trainer/rank0", "kind": "trainer.start", "pid": 11, "step": 10},
               {"ts": 14.0, "source": "trainer/rank0", "kind": "trainer.step", "pid": 11, "step": 11,
                "step_time": 1.0}]
    spare = {"ts": 3.5, "fault": "kill_spare", "target": "node1", "pids": [99], "injected_ts": 3.5}
    kill = {"ts": 11.5, "fault": "kill_worker", "target": "node1", "pids": [10], "injected_ts": 11.5}
    second = {"ts": 12.0, "fault": "kill_during_recovery", "target": "node0", "pids": [12], "injected_ts": 12.0}
    m_spare = fault_metrics(events, spare, None, 11.5)
    assert not m_spare["restarted"] and m_spare["recovery_s"] is None  # the restart at 13 is the kill's
    m_kill = fault_metrics(events, kill, 3.5, 12.0)
    assert m_kill["restarted"] and m_kill["recovery_s"] == 2.5  # a kill's recovery may outlast the next fault
    assert fault_metrics(events, second, 11.5, None)["during_recovery"]  # the replacement had not stepped
    late = {**second, "ts": 14.5, "injected_ts": 14.5}
    assert not fault_metrics(events, late, 11.5, None)["during_recovery"]  # it had: the run re-formed


def _echo_server() -> tuple[socket.socket, threading.Thread]:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=_echo, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return server, thread


def _echo(conn: socket.socket) -> None:
    with conn:
        while data := conn.recv(4096):
            conn.sendall(data)


def _round_trip(endpoint: str, payload: bytes = b"ping", timeout: float = 10.0) -> tuple[bytes, float]:
    host, _, port = endpoint.rpartition(":")
    t0 = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=timeout) as conn:
        conn.sendall(payload)
        data = conn.recv(4096)
    return data, time.monotonic() - t0


def test_proxy_adds_latency_drops_and_blackholes_then_heals():
    server, _ = _echo_server()
    proxy = EtcdProxy(f"127.0.0.1:{server.getsockname()[1]}", seed=1).start()
    try:
        assert _round_trip(proxy.endpoint)[0] == b"ping"
        proxy.set(latency_s=0.25)
        data, took = _round_trip(proxy.endpoint)
        assert data == b"ping" and took >= 0.5  # 0.25 s each way
        proxy.set(latency_s=0.0, drop_rate=1.0)
        try:
            data, _ = _round_trip(proxy.endpoint, timeout=5)
        except OSError:  # a reset; or the close reads as EOF below
            data = b""
        assert data == b"" and proxy.dropped >= 1
        proxy.set(drop_rate=0.0, blackhole=True)
        with pytest.raises(socket.timeout):
            _round_trip(proxy.endpoint, timeout=0.5)
        proxy.reset()
        assert _round_trip(proxy.endpoint)[0] == b"ping"
    finally:
        proxy.close()
        server.close()


def _suite_report(png) -> dict:
    inv = [{"name": "completed", "ok": True, "detail": "last_step=40/40", "evidence": ["10:00:01 trainer/rank0 "
                                                                                     "trainer.done step=40"]},
           {"name": "weights_bitwise_equal", "ok": False, "detail": "final aa vs fault-free bb <&>",
            "evidence": ["final_checksum.txt: aa", "fault-free run: bb"]}]
    fault = {"fault": "kill_worker", "target": "node1", "injected_at_step": 18, "took_effect": True,
             "detected_by": "agent.state/FAILED", "detection_s": 1.2, "recovery_s": 9.5, "steps_lost": 8,
             "resume_step": 10}
    scenario = {"name": "kill_worker", "run_dir": "/tmp/x", "plan": ["kill_worker -> node1 @ step 18"],
                "nodes": "2", "result": {"ok": False, "invariants": inv, "faults": [fault], "goodput": 0.41,
                                         "wall_s": 30.0}}
    return {"job": "examples/tiny.yaml", "workload": "dit", "nodes": 2, "steps": 40, "checkpoint_interval": 10,
            "sets": [], "etcd": "loopback", "baseline_checksum": "bb", "ok": False, "failed": ["kill_worker"],
            "skipped": [{"name": "partition", "reason": "network namespaces need root"}], "elapsed_s": 99.0,
            "scenarios": [scenario]}


def _timeline_png(path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4, 2))
    ax.plot([0, 1, 2], [0, 5, 10])
    fig.savefig(path)
    plt.close(fig)
    return path


def _chromium(*args: str, cwd=None) -> subprocess.CompletedProcess:
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if binary is None:
        pytest.skip("no chromium (apt-get install chromium; .ci/run installs it)")
    return subprocess.run([binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                           "--disable-background-networking", "--disable-component-update", "--disable-sync",
                           *args], capture_output=True, text=True, timeout=120, cwd=cwd)


def test_html_reports_are_self_contained_and_render_in_headless_chromium(tmp_path):
    png = _timeline_png(tmp_path / "timeline.png")
    page = write_suite_html(_suite_report(png), tmp_path / "report.html", png)
    text = page.read_text()
    assert "data:image/png;base64," in text and "http" not in text.replace("http-equiv", "")  # nothing fetched
    assert "&lt;&amp;&gt;" in text  # evidence and details are escaped, never markup
    dom = _chromium(f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", page.as_uri())
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert 'data-timeline-ok="yes"' in dom.stdout  # the embedded picture decoded
    assert "FAILED: kill_worker" in dom.stdout and "network namespaces need root" in dom.stdout
    shot = tmp_path / "shot.png"
    _chromium(f"--user-data-dir={tmp_path / 'profile2'}", "--window-size=1200,1600", f"--screenshot={shot}",
              page.as_uri(), cwd=tmp_path)
    assert shot.read_bytes()[:4] == b"\x89PNG" and shot.stat().st_size > 10_000

    soak = {"ok": True, "broken": [], "job": "tiny.yaml", "nodes": 4, "steps": 900, "injected": 3, "recovered": 3,
            "planned": 4, "mtbf_s": 30.0, "seed": 7, "duration_s": 120.0, "requeues": 1, "skipped_batches": [[33, 33]],
            "replay_checksum": "cc", "goodput": {"goodput": 0.5, "wall_s": 100.0, "productive_s": 50.0,
                                                 "startup_s": 10.0, "recovery_s": 20.0, "checkpoint_s": 5.0,
                                                 "lost_s": 5.0, "other_s": 10.0},
            "per_kind": {"kill_worker": {"injected": 3, "recovered": 3, "mean_recovery_s": 6.0, "max_recovery_s": 7.0,
                                         "steps_lost": 9, "cost_s": 19.5, "goodput_cost": 0.195}},
            "soak": {"result": {"faults": [], "invariants": []}}}
    soak_page = write_soak_html(soak, tmp_path / "soak.html", png)
    dom = _chromium(f"--user-data-dir={tmp_path / 'profile3'}", "--dump-dom", soak_page.as_uri())
    assert 'data-timeline-ok="yes"' in dom.stdout and "19.5%" in dom.stdout and json.dumps(3) in dom.stdout
