"""Numerics guard: keep NaN/Inf and loss spikes out of the weights.

The trainer calls :meth:`NumericsGuard.check` after backward and before the
optimizer step with the *global* loss (averaged over all ranks) and the global
gradient norm, so every rank reaches the same verdict without extra
communication.  Verdicts:

* ``ok``: the loss joins the history window; the optimizer steps.
* ``skip``: the step is dropped (gradients discarded, no optimizer update,
  the data is still consumed); counted.  More than ``max_consecutive_skips``
  skips in a row escalate to ``rollback``: a run that keeps producing bad steps
  needs an older checkpoint, not more skipping.
* ``rollback``: the trainer reports to its agent
  (``WorkerContext.report_numerics``) and exits with ``EXIT_NUMERICS``.

Spikes use a robust z-score over the last ``spike_window`` accepted losses:
z = (loss - median) / (1.4826 * MAD), 1.4826 making the MAD a consistent
estimate of the standard deviation for normal data; the denominator is
floored at ``spike_min_rel_scale * median`` so that a nearly constant history
does not turn noise into spikes.  Only upward spikes count.
A flagged loss never enters the history, so one spike cannot mask the next.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any, Literal

import torch

from trainer.dit_config import NumericsConfig

MAD_TO_STD = 1.4826


@dataclass(frozen=True)
class Verdict:
    action: Literal["ok", "skip", "rollback"]
    reason: str = ""
    zscore: float | None = None

    @property
    def ok(self) -> bool:
        return self.action == "ok"


def robust_zscore(value: float, history: list[float], min_rel_scale: float = 0.0) -> float:
    """(value - median) / max(1.4826 * MAD, min_rel_scale * |median|).

    The floor matters when the history is nearly constant: the MAD then
    collapses towards 0 and any tiny increase would look like a huge z.
    """
    hist = torch.tensor(history, dtype=torch.float64)
    median = float(torch.quantile(hist, 0.5))
    mad = float(torch.quantile((hist - median).abs(), 0.5))
    scale = max(MAD_TO_STD * mad, min_rel_scale * abs(median), 1e-12)
    return (value - median) / scale


class NumericsGuard:
    def __init__(self, cfg: NumericsConfig) -> None:
        self.cfg = cfg
        self.history: deque[float] = deque(maxlen=cfg.spike_window)
        self.consecutive_skips = 0
        self.total_skips = 0

    def check(self, loss: float, grad_norm: float) -> Verdict:
        verdict = self._judge(loss, grad_norm)
        if verdict.action == "ok":
            self.history.append(loss)
            self.consecutive_skips = 0
            return verdict
        if verdict.action == "skip":
            if self.consecutive_skips + 1 > self.cfg.max_consecutive_skips:
                return Verdict(
                    "rollback", f"{verdict.reason}; {self.consecutive_skips + 1} bad steps in a row", verdict.zscore
                )
            self.consecutive_skips += 1
            self.total_skips += 1
        return verdict

    def _judge(self, loss: float, grad_norm: float) -> Verdict:
        bad = self.cfg.action
        if not math.isfinite(loss):
            return Verdict(bad, f"non-finite loss ({loss})")
        if not math.isfinite(grad_norm):
            return Verdict(bad, f"non-finite grad norm ({grad_norm})")
        if self.cfg.spike_zscore > 0 and len(self.history) >= self.cfg.spike_min_history:
            z = robust_zscore(loss, list(self.history), self.cfg.spike_min_rel_scale)
            if z > self.cfg.spike_zscore:
                return Verdict(bad, f"loss spike (robust z = {z:.1f} > {self.cfg.spike_zscore})", z)
        return Verdict("ok")

    # -- checkpoint state (fixed shapes, so DCP can load into a fresh guard) --
    def state_dict(self) -> dict[str, Any]:
        hist = torch.full((self.cfg.spike_window,), float("nan"), dtype=torch.float64)
        values = list(self.history)
        if values:
            hist[: len(values)] = torch.tensor(values, dtype=torch.float64)
        return {
            "history": hist,
            "history_len": len(values),
            "consecutive_skips": self.consecutive_skips,
            "total_skips": self.total_skips,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        n = int(state["history_len"])
        hist = state["history"]
        self.history.clear()
        self.history.extend(float(v) for v in hist[:n].tolist())
        self.consecutive_skips = int(state["consecutive_skips"])
        self.total_skips = int(state["total_skips"])
