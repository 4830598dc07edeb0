"""A running run's state as etcd holds it, for people (table) and tools (JSON).

Keys read (all under ``<key_prefix>/runs/<run_id>``, see :mod:`elastic.agent.node`,
:mod:`elastic.control.keys`, :mod:`elastic.checkpoint.publish`)::

    nodes/<node>        agent record (state, failures, host, metrics address), leased
    heartbeat/<node>    step, loss, step time, epoch (published every few seconds), leased
    excluded/<node>     exclusion record {reason, until, by}
    checkpoint/latest   newest committed checkpoint {step, path, world_size}
    epoch, leader, done, stop

Used by ``elastic status`` and by the live table of ``elastic-launch``.
"""

from __future__ import annotations

import time
from typing import Any

from elastic.control.keys import RunKeys, run_prefix, runs_root
from elastic.control.runstate import RunState
from elastic.control.store import KVStore, StoreError

_AGENT_KEYS = frozenset({"nodes", "heartbeat", "excluded", "checkpoint", "epoch", "leader", "done", "stop"})


def list_runs(store: KVStore, key_prefix: str) -> list[str]:
    """Run ids with agent keys under ``key_prefix`` (torchrun's per-epoch rendezvous ids are not runs)."""
    root = runs_root(key_prefix)
    runs = set()
    for kv in store.get_prefix(root):
        run, _, rest = RunKeys.tail(kv.key, root).partition("/")
        if rest.split("/", 1)[0] in _AGENT_KEYS:
            runs.add(run)
    return sorted(runs)


def read_status(store: KVStore, prefix: str) -> dict[str, Any]:
    """Everything ``elastic status`` shows for the run rooted at ``prefix`` (StoreError if etcd is down)."""
    state = RunState(store, RunKeys(prefix))
    nodes = {name: {"state": rec.get("state"), "host": rec.get("host"), "failures": rec.get("failures"),
                    "metrics": rec.get("metrics")} for name, rec in state.nodes().items()}
    now = time.time()
    for name, hb in state.heartbeats().items():
        node = nodes.setdefault(name, {"state": hb.get("state")})
        step_time = hb.get("step_time")
        node.update({"step": hb.get("step"), "loss": hb.get("loss"), "step_time": step_time,
                     "steps_per_s": (1.0 / step_time) if step_time else None, "epoch": hb.get("epoch"),
                     "heartbeat_age_s": round(now - hb["ts"], 3) if hb.get("ts") else None})
    return {
        "prefix": prefix,
        "epoch": state.epoch(),
        "leader": state.leader(),
        "nodes": dict(sorted(nodes.items())),
        "excluded": state.exclusions.all(),
        "checkpoint": state.latest_checkpoint(),
        "done": state.done_record() is not None,
        "stop": state.stop_record() or None,
    }


def _fmt(value: Any, spec: str = "") -> str:
    if value is None:
        return "-"
    return format(value, spec) if spec else str(value)


def table_rows(status: dict[str, Any]) -> list[tuple[str, ...]]:
    rows = []
    for name, n in status["nodes"].items():
        state = "EXCLUDED" if name in status["excluded"] and n.get("state") != "RUNNING" else _fmt(n.get("state"))
        rows.append((name, state, _fmt(n.get("step")), _fmt(n.get("loss"), ".4g"), _fmt(n.get("steps_per_s"), ".2f"),
                     _fmt(n.get("failures")), _fmt(n.get("metrics"))))
    for name in status["excluded"]:
        if name not in status["nodes"]:
            rows.append((name, "EXCLUDED", "-", "-", "-", "-", "-"))
    return rows


HEADER = ("node", "state", "step", "loss", "steps/s", "failures", "metrics")


def headline(status: dict[str, Any]) -> str:
    ckpt = status["checkpoint"]
    parts = [f"run {status['prefix'].rsplit('/', 1)[-1]}", f"epoch {status['epoch']}",
             f"leader {status['leader'] or '-'}",
             f"checkpoint {('step ' + str(ckpt['step'])) if ckpt else '-'}"]
    if status["done"]:
        parts.append("done")
    if status["stop"]:
        parts.append(f"stopped: {status['stop'].get('reason')}")
    return ", ".join(parts)


def format_plain(status: dict[str, Any]) -> str:
    rows = [HEADER, *table_rows(status)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER))]
    lines = [headline(status)] + ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    for name, rec in status["excluded"].items():
        lines.append(f"excluded {name}: {rec.get('reason')} (by {rec.get('by') or '-'})")
    if status["checkpoint"]:
        lines.append(f"newest checkpoint: step {status['checkpoint']['step']} at {status['checkpoint']['path']}")
    return "\n".join(lines)


def render_table(status: dict[str, Any]):
    """A rich renderable: the headline as title, one row per node."""
    from rich.table import Table

    table = Table(title=headline(status), title_justify="left")
    for col in HEADER:
        table.add_column(col, justify="right" if col in ("step", "loss", "steps/s", "failures") else "left")
    for row in table_rows(status):
        table.add_row(*row, style="red" if row[1] in ("EXCLUDED", "FAILED", "GAVE_UP") else None)
    return table


class LiveStatus:
    """``elastic-launch``'s live table while agents run (only when stdout is a terminal)."""

    def __init__(self, store: KVStore, prefix: str, interval_s: float = 1.0, console=None) -> None:
        from rich.console import Console
        from rich.live import Live

        self.store = store
        self.prefix = prefix
        self.interval_s = interval_s
        self._next = 0.0
        self._last: dict[str, Any] | None = None
        self._live = Live(console=console or Console(), auto_refresh=False, transient=False)
        self._live.start()

    def update(self) -> None:
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self.interval_s
        try:
            status = read_status(self.store, self.prefix)
        except (StoreError, ValueError) as exc:  # a status display must never take the launcher down
            from rich.text import Text

            self._live.update(Text(f"status unavailable: {exc}"), refresh=True)
            return
        if status["nodes"] or self._last is None:
            self._last = status
        else:  # leased node records vanish as agents exit: keep the last table that had them
            self._last = {**self._last, "done": status["done"], "stop": status["stop"], "checkpoint": status["checkpoint"]}
        self._live.update(render_table(self._last), refresh=True)

    def close(self) -> None:
        self._live.stop()


def resolve_prefix(key_prefix: str, run_id: str | None, prefix: str | None) -> str | None:
    if prefix:
        return prefix.rstrip("/")
    if run_id:
        return run_prefix(key_prefix, run_id)
    return None
