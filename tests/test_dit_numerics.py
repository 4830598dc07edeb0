"""Numerics guard: NaN/Inf, robust loss-spike z-score, skip bound, checkpoint state."""

from __future__ import annotations

import math

import pytest

from elastic.common.config import from_dict
from trainer.dit_config import NumericsConfig
from trainer.numerics import NumericsGuard, robust_zscore


def guard(**kw) -> NumericsGuard:
    return NumericsGuard(from_dict(NumericsConfig, {"spike_window": 8, "spike_min_history": 4, "spike_zscore": 6.0,
                                                    "max_consecutive_skips": 2, **kw}))


def warm(g: NumericsGuard, n: int = 8) -> None:
    for i in range(n):
        assert g.check(1.0 + 0.01 * (i % 3), 1.0).ok


def test_robust_zscore():
    hist = [1.0, 1.1, 0.9, 1.0, 1.05, 0.95]
    # median 1.0, MAD 0.05 -> sigma 0.0741
    assert robust_zscore(1.0, hist) == pytest.approx(0.0)
    assert robust_zscore(1.5, hist) == pytest.approx(0.5 / (1.4826 * 0.05))
    # a single outlier in the history hardly moves median/MAD (unlike mean/std)
    assert robust_zscore(1.5, hist + [100.0]) > 5


@pytest.mark.parametrize(("loss", "norm", "reason"), [
    (math.nan, 1.0, "non-finite loss"), (math.inf, 1.0, "non-finite loss"), (1.0, math.nan, "non-finite grad norm"),
    (1.0, math.inf, "non-finite grad norm")])
def test_non_finite_is_skipped_from_the_first_step(loss, norm, reason):
    g = guard()
    verdict = g.check(loss, norm)
    assert verdict.action == "skip" and reason in verdict.reason
    assert g.total_skips == 1 and len(g.history) == 0


def test_spike_detected_after_min_history_only():
    g = guard()
    assert g.check(1.0, 1.0).ok and g.check(50.0, 1.0).ok  # too little history to judge
    g = guard()
    warm(g)
    verdict = g.check(3.0, 1.0)
    assert verdict.action == "skip" and "spike" in verdict.reason and verdict.zscore > 6
    assert 3.0 not in g.history  # a flagged loss never enters the window
    assert g.check(0.5, 1.0).ok  # downward moves are fine
    assert g.check(1.02, 1.0).ok


def test_consecutive_skips_are_bounded_then_escalate():
    g = guard()
    warm(g)
    assert g.check(math.nan, 1.0).action == "skip"
    assert g.check(math.nan, 1.0).action == "skip"
    third = g.check(math.nan, 1.0)
    assert third.action == "rollback" and "3 bad steps in a row" in third.reason
    g2 = guard()
    assert g2.check(math.nan, 1.0).action == "skip"
    assert g2.check(1.0, 1.0).ok  # a good step resets the run of skips
    assert g2.consecutive_skips == 0 and g2.total_skips == 1


def test_rollback_action():
    g = guard(action="rollback")
    assert g.check(math.nan, 1.0).action == "rollback"


def test_spike_detection_can_be_disabled():
    g = guard(spike_zscore=0.0)
    warm(g)
    assert g.check(1e6, 1.0).ok


def test_state_round_trip():
    g = guard()
    warm(g, 5)
    g.check(math.nan, 1.0)
    state = g.state_dict()
    assert state["history"].shape == (8,)  # fixed shape: DCP loads into a fresh guard's tensor
    h = guard()
    h.load_state_dict(state)
    assert list(h.history) == list(g.history)
    assert (h.consecutive_skips, h.total_skips) == (1, 1)
    assert h.check(5.0, 1.0).action == g.check(5.0, 1.0).action == "skip"
