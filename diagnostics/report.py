"""Check results, the screen report, and the text table the CLI prints."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

Verdict = Literal["pass", "warn", "fail", "skip"]
VERDICTS = ("pass", "warn", "fail", "skip")
_RANK = {"skip": 0, "pass": 1, "warn": 2, "fail": 3}


@dataclass(kw_only=True, slots=True)
class CheckResult:
    """Outcome of one check.

    ``value`` and ``threshold`` are what the table shows (a number, a short
    string, or a small ``{label: number}`` dict); ``details`` holds every raw
    number the verdict was derived from.  For ``skip``, ``reason`` starts with
    ``"skipped: "`` and says why.
    """

    name: str
    verdict: Verdict
    value: Any = None
    threshold: Any = None
    reason: str = ""
    details: dict[str, Any] = field(default_factory=dict)
    duration_s: float = 0.0

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict must be one of {VERDICTS}, got {self.verdict!r}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "verdict": self.verdict,
            "value": self.value,
            "threshold": self.threshold,
            "reason": self.reason,
            "details": self.details,
            "duration_s": round(self.duration_s, 4),
        }


def worst(verdicts: list[str]) -> str:
    """Combine sub-verdicts: fail > warn > pass > skip (all skip stays skip)."""
    return max(verdicts, key=_RANK.__getitem__) if verdicts else "skip"


@dataclass(kw_only=True, slots=True)
class Report:
    host: str
    ts: float
    mode: str
    checks: list[CheckResult]
    duration_s: float

    @property
    def verdict(self) -> str:
        """``fail`` if any check failed, else ``warn`` if any warned, else ``pass``.

        Skipped checks do not make a screen fail, and they are not passes either:
        they are listed in :attr:`skipped` with their reasons.
        """
        states = {c.verdict for c in self.checks}
        if "fail" in states:
            return "fail"
        if "warn" in states:
            return "warn"
        return "pass"

    @property
    def failures(self) -> list[str]:
        return [f"{c.name}: {c.reason}" for c in self.checks if c.verdict == "fail"]

    @property
    def warnings(self) -> list[str]:
        return [f"{c.name}: {c.reason}" for c in self.checks if c.verdict == "warn"]

    @property
    def skipped(self) -> list[str]:
        return [f"{c.name}: {c.reason}" for c in self.checks if c.verdict == "skip"]

    def check(self, name: str) -> CheckResult:
        for c in self.checks:
            if c.name == name:
                return c
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        return {
            "host": self.host,
            "ts": self.ts,
            "mode": self.mode,
            "verdict": self.verdict,
            "checks": [c.to_dict() for c in self.checks],
            "duration_s": round(self.duration_s, 3),
        }

    def summary(self) -> dict[str, Any]:
        """Short form for exclusion records."""
        return {
            "host": self.host,
            "ts": self.ts,
            "mode": self.mode,
            "verdict": self.verdict,
            "failures": self.failures,
            "warnings": self.warnings,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False, default=str)

    def table(self) -> str:
        rows = [("check", "value", "threshold", "verdict", "reason")]
        for c in self.checks:
            rows.append((c.name, fmt(c.value), fmt(c.threshold), c.verdict.upper(), c.reason))
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = []
        for i, r in enumerate(rows):
            lines.append("  ".join(cell.ljust(w) for cell, w in zip(r[:4], widths)) + "  " + r[4])
            if i == 0:
                lines.append("  ".join("-" * w for w in widths) + "  " + "-" * 6)
        skipped = len(self.skipped)
        lines.append(
            f"overall: {self.verdict.upper()}  ({len(self.checks)} checks, {skipped} skipped, "
            f"{self.duration_s:.2f} s, mode {self.mode}, host {self.host})"
        )
        return "\n".join(lines)


def fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        # {"fp32": ">=0.5 (fail<0.3)"} reads as "fp32>=0.5 (fail<0.3)"; numbers as "k=v".
        return " ".join(f"{k}{v}" if isinstance(v, str) and v[:1] in "<>" else f"{k}={fmt(v)}"
                        for k, v in value.items())
    return str(value)
