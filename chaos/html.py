"""One self-contained HTML report per suite or soak, for the operator who has to trust the verdict.

Everything is in the one file: styles inline, the fault timeline PNG embedded as a data URI,
no script or font from anywhere else, so it opens from a CI artifact or an e-mail as it is.
It shows the verdict first, then a table of scenarios (recovery time, steps lost, goodput),
the timeline, and per scenario its faults and every invariant with the event lines it rests on.
A few lines of inline script only mark, after load, that the picture decoded
(``body[data-timeline-ok]``), which the test in a headless browser reads.
"""

from __future__ import annotations

import base64
import html
import time
from pathlib import Path
from typing import Any

_STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#222;max-width:1200px}
h1{font-size:22px;margin-bottom:4px} h2{font-size:18px;margin-top:28px;border-bottom:1px solid #ccc}
h3{font-size:15px;margin:18px 0 6px}
table{border-collapse:collapse;margin:8px 0 16px} th,td{border:1px solid #ccc;padding:3px 8px;text-align:left;
vertical-align:top} th{background:#f3f3f3} td.num{text-align:right;font-variant-numeric:tabular-nums}
.pass{color:#0a6d1e;font-weight:600} .fail{color:#b00020;font-weight:600} .skip{color:#777}
.verdict{font-size:20px;padding:6px 12px;display:inline-block;border-radius:4px}
.verdict.pass{background:#e4f6e8} .verdict.fail{background:#fde8eb}
pre{margin:2px 0;font-size:12px;white-space:pre-wrap;color:#444} img{max-width:100%;border:1px solid #ddd}
.meta td{border:none;padding:1px 12px 1px 0}
"""
_SCRIPT = """
window.addEventListener('load', function () {
  var img = document.getElementById('timeline');
  document.body.setAttribute('data-timeline-ok', img && img.complete && img.naturalWidth > 0 ? 'yes' : 'no');
  document.body.setAttribute('data-tables', String(document.getElementsByTagName('table').length));
});
"""


def _e(value: Any) -> str:
    return html.escape("" if value is None else str(value))


def _verdict(ok: bool, skipped: bool = False) -> str:
    if skipped:
        return '<span class="skip">SKIPPED</span>'
    return '<span class="pass">PASS</span>' if ok else '<span class="fail">FAIL</span>'


def table(header: list[str], rows: list[list[Any]], raw_cols: tuple[int, ...] = (),
          num_cols: tuple[int, ...] = ()) -> str:
    """An HTML table; cells are escaped unless their column is in ``raw_cols`` (already HTML)."""
    head = "".join(f"<th>{_e(h)}</th>" for h in header)
    body = []
    for row in rows:
        cells = []
        for i, cell in enumerate(row):
            cls = ' class="num"' if i in num_cols else ""
            cells.append(f"<td{cls}>{cell if i in raw_cols else _e(cell)}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def image(png: Path | None) -> str:
    if png is None or not Path(png).is_file():
        return "<p>(no timeline picture)</p>"
    data = base64.b64encode(Path(png).read_bytes()).decode()
    return f'<img id="timeline" alt="fault timeline" src="data:image/png;base64,{data}">'


def page(title: str, body: str) -> str:
    return (f"<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>{_e(title)}</title>"
            f"<style>{_STYLE}</style></head><body>{body}<script>{_SCRIPT}</script></body></html>")


def _fmt(value: Any, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec) if isinstance(value, (int, float)) else str(value)


def faults_table(faults: list[dict[str, Any]]) -> str:
    rows = [[f["fault"], f["target"], _fmt(f.get("injected_at_step"), "d"), "yes" if f.get("took_effect") else "no",
             f.get("detected_by") or "-", _fmt(f.get("detection_s")), _fmt(f.get("recovery_s")),
             _fmt(f.get("steps_lost"), "d"), _fmt(f.get("resume_step"), "d")] for f in faults]
    return table(["fault", "target", "at step", "took effect", "detected by", "detection s", "recovery s",
                  "steps lost", "resumed at"], rows, num_cols=(2, 5, 6, 7, 8))


def invariants_table(invariants: list[dict[str, Any]]) -> str:
    rows = [[_verdict(i["ok"]), _e(i["name"]), _e(i["detail"]),
             "".join(f"<pre>{_e(line)}</pre>" for line in i.get("evidence", [])) or "-"] for i in invariants]
    return table(["verdict", "invariant", "detail", "evidence"], rows, raw_cols=(0, 1, 2, 3))


def scenario_rows(scenarios: list[dict[str, Any]]) -> list[list[Any]]:
    rows = []
    for s in scenarios:
        res = s.get("result", {})
        faults = res.get("faults", [])
        failed = [i["name"] for i in res.get("invariants", []) if not i["ok"]]
        rows.append([_e(s["name"]), _verdict(res.get("ok", False)), len(faults),
                     ", ".join(_fmt(f.get("recovery_s")) for f in faults) or "-",
                     ", ".join(_fmt(f.get("steps_lost"), "d") for f in faults) or "-",
                     _fmt(res.get("goodput"), ".3f"), _fmt(res.get("wall_s")), _e(", ".join(failed) or "-")])
    return rows


def write_suite_html(report: dict[str, Any], path: Path, png: Path | None) -> Path:
    ok = report["ok"]
    meta = table([], [["job", report.get("job")], ["workload", report.get("workload")],
                      ["nodes / steps / checkpoint interval",
                       f"{report.get('nodes')} / {report.get('steps')} / {report.get('checkpoint_interval')}"],
                      ["settings", " ".join(report.get("sets") or []) or "(the job as written)"],
                      ["etcd", report.get("etcd")], ["fault-free checksum", report.get("baseline_checksum")],
                      ["written", time.strftime("%Y-%m-%d %H:%M:%S")], ["suite time", f"{report.get('elapsed_s')} s"]])
    parts = [f"<h1>Chaos suite</h1><div class=\"verdict {'pass' if ok else 'fail'}\">"
             f"{'every invariant held' if ok else 'FAILED: ' + _e(', '.join(report['failed']))}</div>",
             meta.replace("<table>", '<table class="meta">', 1), "<h2>Scenarios</h2>",
             table(["scenario", "verdict", "faults", "recovery s", "steps lost", "goodput", "wall s",
                    "failed invariants"], scenario_rows(report["scenarios"]), raw_cols=(0, 1, 7), num_cols=(2, 5, 6))]
    if report.get("skipped"):
        parts += ["<h3>Not run against this job</h3>",
                  table(["scenario", "why"], [[s["name"], s["reason"]] for s in report["skipped"]])]
    parts += ["<h2>Fault timeline</h2>", image(png)]
    for s in report["scenarios"]:
        res = s.get("result", {})
        parts += [f"<h2 id=\"{_e(s['name'])}\">{_e(s['name'])} {_verdict(res.get('ok', False))}</h2>",
                  f"<p>plan: {_e('; '.join(s.get('plan', [])) or 'no faults (reference run)')}; nodes "
                  f"{_e(s.get('nodes'))}; compared with the {_e(s.get('reference', 'baseline'))}; run dir "
                  f"<code>{_e(s.get('run_dir'))}</code></p>"]
        if res.get("faults"):
            parts.append(faults_table(res["faults"]))
        parts.append(invariants_table(res.get("invariants", [])))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page("chaos suite report", "".join(parts)))
    return path


def _mttr(m: dict[str, Any] | None) -> str:
    if not m or not m.get("n"):
        return "-"
    return f"p50 {_fmt(m['p50'], '.2f')} s, p95 {_fmt(m['p95'], '.2f')} s over {m['n']} faults"


def write_soak_html(report: dict[str, Any], path: Path, png: Path | None) -> Path:
    ok, g = report["ok"], report["goodput"]
    parts = ("productive_s", "startup_s", "recovery_s", "checkpoint_s", "lost_s", "other_s")
    wall = g.get("wall_s") or 0.0
    body = [f"<h1>Chaos soak</h1><div class=\"verdict {'pass' if ok else 'fail'}\">"
            f"{'every invariant held' if ok else 'BROKEN: ' + _e(', '.join(i['name'] for i in report['broken']))}</div>",
            table([], [["job", report["job"]], ["nodes / steps", f"{report['nodes']} / {report['steps']}"],
                       ["faults", f"{report['injected']} injected, {report['recovered']} recovered, "
                                  f"{report['planned']} planned (mtbf {report['mtbf_s']:g}s, seed {report['seed']}, "
                                  f"{report['duration_s']:g}s)"],
                       ["node relaunches", report["requeues"]], ["skipped batches", report["skipped_batches"] or "none"],
                       ["etcd members", report.get("etcd_members", 1)],
                       ["hung", "YES: the run did not end on its own" if report.get("hung") else "no"],
                       ["goodput excluding startup", _fmt(report.get("goodput_excl_startup"), ".3f")],
                       ["the same, fault-free replay (baseline)",
                        _fmt((report.get("fault_free") or {}).get("goodput_excl_startup"), ".3f")],
                       ["recovery time (faults that needed one)", _mttr(report.get("mttr_s"))],
                       ["fault-free replay checksum", report["replay_checksum"]]]).replace("<table>", '<table class="meta">', 1),
            "<h2>Goodput</h2>",
            table(["part", "seconds", "share of wall"],
                  [[p[:-2], _fmt(g.get(p), ".1f"), f"{(g.get(p) or 0) / wall * 100:.1f}%" if wall else "-"]
                   for p in parts] + [["wall", _fmt(wall), "100%"], ["goodput", _fmt(g.get("goodput"), ".3f"), ""]],
                  num_cols=(1, 2)),
            "<h2>Per fault kind</h2>",
            table(["fault", "injected", "recovered", "mean recovery s", "max recovery s", "steps lost", "cost s",
                   "goodput cost"],
                  [[kind, k["injected"], k["recovered"], _fmt(k["mean_recovery_s"]), _fmt(k["max_recovery_s"]),
                    k["steps_lost"], _fmt(k["cost_s"]), f"{(k['goodput_cost'] or 0) * 100:.1f}%"]
                   for kind, k in sorted(report["per_kind"].items())], num_cols=(1, 2, 3, 4, 5, 6, 7)),
            "<h2>Fault timeline</h2>", image(png), "<h2>Faults</h2>",
            faults_table(report["soak"]["result"]["faults"]), "<h2>Invariants</h2>",
            invariants_table(report["soak"]["result"]["invariants"])]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page("chaos soak report", "".join(body)))
    return path
