"""Library API for the node agent: run a screen, and exclude the node if it failed.

::

    report = run_screen("quick", etcd_endpoint=ep, ckpt_dir=ckpt)
    if exclude_if_failed(report, store, run_prefix, node_id, ttl_s=3600):
        sys.exit(EXIT_DO_NOT_REQUEUE)

The quick screen takes ~0.5-1 s on a CPU host (GEMM and copy 0.05 s per dtype,
a 2-rank gloo all-reduce of 1 MiB); pass ``checks=[...]`` to run a subset.
"""

from __future__ import annotations

import os
from pathlib import Path
import socket
import time
from collections.abc import Iterable, Mapping
from typing import Any

from diagnostics import checks as registry
from diagnostics.calibration import Calibration, calibrate, load_calibration
from diagnostics.readers import HardwareReader, InjectedReader, default_reader
from diagnostics.report import Report
from diagnostics.thresholds import Thresholds, load_thresholds
from elastic.control.keys import RunKeys
from elastic.control.runstate import RunState

MODES = ("quick", "full")
IN_WORKER_SKIPPED = frozenset({"collective"})
#: How long NVML is listened to for Xid events during a screen (the kernel log covers earlier ones).
XID_WINDOW_S = {"quick": 0.1, "full": 5.0}


def run_screen(
    mode: str = "quick",
    config: Thresholds | str | os.PathLike[str] | dict[str, Any] | None = None,
    inject: str | os.PathLike[str] | Mapping[str, Any] | None = None,
    etcd_endpoint: str | None = None,
    ckpt_dir: str | os.PathLike[str] | None = None,
    checks: Iterable[str] | None = None,
    reader: HardwareReader | None = None,
    host: str | None = None,
    calibration: Calibration | str | os.PathLike[str] | None = None,
) -> Report:
    """Run ``checks`` (default: all registered) and return the :class:`Report`.

    ``config`` is a :class:`Thresholds`, a YAML path or a dict (ConfigError on a
    bad field); ``inject`` a YAML path or dict overlaid on the host readings
    (default: ``$ELASTIC_DIAG_INJECT``); ``reader`` replaces the host reader
    entirely (``inject`` is then overlaid on it).  ``calibration`` (a :class:`Calibration` or a
    file from ``diag calibrate``; default: the thresholds' ``calibration`` path) replaces the
    datasheet figures for the measurements it covers (CalibrationError on a bad file).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    thresholds = config if isinstance(config, Thresholds) else load_thresholds(config)
    if reader is None:
        reader = default_reader(inject, xid_window_s=XID_WINDOW_S[mode])
    elif inject is not None:
        reader = InjectedReader.from_file(reader, inject) if not isinstance(inject, Mapping) else InjectedReader(reader, inject)
    names = [registry.resolve(n) for n in checks] if checks is not None else registry.all_names()
    if calibration is None and thresholds.calibration:
        calibration = thresholds.calibration
    if calibration is not None and not isinstance(calibration, Calibration):
        calibration = load_calibration(calibration)
    ctx = registry.Context(
        mode=mode,
        thresholds=thresholds,
        reader=reader,
        etcd_endpoint=etcd_endpoint,
        ckpt_dir=os.fspath(ckpt_dir) if ckpt_dir is not None else None,
        host=host or socket.gethostname(),
        calibration=calibration,
    )
    ts = time.time()
    start = time.perf_counter()
    results = [registry.get(name)(ctx) for name in names]
    return Report(host=ctx.host, ts=ts, mode=mode, checks=results, duration_s=time.perf_counter() - start)


def run_calibration(mode: str = "quick", checks: Iterable[str] | None = None, repeats: int = 5,
                    config: Thresholds | str | os.PathLike[str] | dict[str, Any] | None = None,
                    reader: HardwareReader | None = None) -> Calibration:
    """``repeats`` screens of the calibrating checks (gemm, membw, collective by default) on this
    (known-good) node, summarised per check, size and dtype; see :mod:`diagnostics.calibration`."""
    from diagnostics.calibration import CHECKS

    thresholds = config if isinstance(config, Thresholds) else load_thresholds(config)
    names = list(checks) if checks is not None else list(CHECKS)
    # No calibration while calibrating: every measurement is judged against the datasheet only.
    thresholds.calibration = ""

    def screen(only: list[str]) -> Report:
        return run_screen(mode, config=thresholds, checks=only, reader=reader)

    return calibrate(screen, names, repeats, mode)


def exclude_if_failed(report: Report, store: Any, run_prefix: str, node_id: str, ttl_s: float | None) -> bool:
    """Record ``report`` under ``<run_prefix>/diag/<node_id>``; if it failed, exclude the node.

    The exclusion record at ``<run_prefix>/excluded/<node_id>`` has the format
    :class:`elastic.control.runstate.Exclusions` reads (``reason``, ``until``, ``by``,
    ``ts``) plus ``report`` (the summary).  ``until`` is ``ts + ttl_s``, or None
    (no expiry) when ``ttl_s`` is None or 0.  Returns True when the node was
    excluded.  Store errors propagate (the caller decides whether to fail open).
    """
    state = RunState(store, RunKeys(run_prefix))
    state.put_diag(node_id, report.to_json())
    if report.verdict != "fail":
        return False
    state.exclusions.add(node_id, "diag: " + "; ".join(report.failures), ttl_s=ttl_s, by="diag",
                         report=report.summary())
    return True


def screen_in_worker(spec: Mapping[str, Any]) -> dict[str, Any]:
    """The node screen run inside a training worker (entry point ``elastic.screens: diag``).

    The worker has torch imported already, so the screen costs only its checks, and it runs while
    the worker builds its model and joins its process group; the worker holds its first step until
    the verdict.  ``spec`` comes from the node agent (mode, checks, thresholds, inject, etcd
    endpoint, checkpoint dir, report path); the report is written where the agent's screen writes it.
    """
    # The collective check forms a process group of its own, which a worker (already in its run's
    # group) cannot; the worker's own first collectives exercise the fabric instead.
    checks = spec.get("checks") or [n for n in registry.all_names() if n not in IN_WORKER_SKIPPED]
    report = run_screen(spec.get("mode", "quick"), config=spec.get("thresholds") or None,
                        inject=spec.get("inject") or None, etcd_endpoint=spec.get("etcd_endpoint"),
                        ckpt_dir=spec.get("ckpt_dir"), checks=[c for c in checks if c not in IN_WORKER_SKIPPED])
    if spec.get("report"):
        path = Path(spec["report"])
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(report.to_json())
    return {"passed": report.verdict != "fail", "reason": "; ".join(report.failures),
            "duration_s": round(report.duration_s, 3)}
