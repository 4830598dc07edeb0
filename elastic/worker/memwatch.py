"""Peak resident memory of this process: what a re-formation costs against a training step.

A re-forming rank rebuilds its trainer and restores its state while the old world's objects may
still be alive; if that transient peak is a multiple of a step's, a run that fits its hosts while
training does not fit them while recovering.  Linux keeps the high-water mark of the resident set
(``VmHWM`` in ``/proc/self/status``), and writing ``5`` to ``/proc/self/clear_refs`` resets it to
the current RSS, so a window's peak costs one read and one write, and no sampling thread (which
would miss a short spike and cost CPU on every step).

:class:`RecoveryPeak` keeps the peak of each window of steps over the last few windows (the steady state) and
reports a recovery's peak as ``peak_rss_ratio`` (recovery peak / steady state).  Without torch:
the helper reads only ``/proc``.
"""

from __future__ import annotations

from collections import deque
from typing import Any

STATUS = "/proc/self/status"
CLEAR_REFS = "/proc/self/clear_refs"
RESET_HIGH_WATER = "5"
"""``clear_refs`` value that resets the peak RSS only (1-4 would walk and clear page bits)."""


class PeakUnavailable(OSError):
    """This process cannot read or reset its peak RSS (not Linux, or ``/proc`` is not writable)."""


def _status_bytes(field: str) -> int:
    """A ``kB`` line of ``/proc/self/status`` in bytes."""
    try:
        with open(STATUS, encoding="ascii") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError as exc:
        raise PeakUnavailable(f"cannot read {STATUS}: {exc}") from exc
    raise PeakUnavailable(f"{STATUS} has no {field} line")


def rss_bytes() -> int:
    """The resident set now."""
    return _status_bytes("VmRSS")


def peak_bytes() -> int:
    """The resident set's high-water mark since the process started or the last :func:`reset_peak`."""
    return _status_bytes("VmHWM")


def reset_peak() -> None:
    """Start a new peak window: the high-water mark becomes the current RSS."""
    try:
        with open(CLEAR_REFS, "w", encoding="ascii") as refs:
            refs.write(RESET_HIGH_WATER)
    except OSError as exc:
        raise PeakUnavailable(f"cannot reset the peak RSS through {CLEAR_REFS}: {exc}") from exc


def _mb(nbytes: int | None) -> float | None:
    return round(nbytes / 2**20, 1) if nbytes is not None else None


class RecoveryPeak:
    """A rank's peak RSS while it re-forms, against its peak in a training step.

    Call :meth:`step_done` at the end of every step, :meth:`recovery_started` when a peer is found
    lost, and :meth:`recovered` once the state is restored (its fields go into the recovery's
    event).  Where ``/proc`` cannot be used every call is a no-op and the fields say ``None``:
    measuring must never stop training.
    """

    def __init__(self, steady_steps: int = 5, every: int = 10) -> None:
        self.steady: deque[int] = deque(maxlen=steady_steps)
        """The peak of each of the last windows: the steady state is their maximum (one step's peak
        is noisy: a checkpoint's staging or a collector pass lands on some steps only)."""
        self.every = every
        """Steps per window after the first (which is one step, so that a fault early in a world
        still has a steady state).  Why not every step: the read of ``/proc/self/status`` and the
        reset cost the training thread 0.6 ms per step on the 4-node soak config (2 shared cores,
        py-spy at 200 Hz on rank 0: 21 of 4,999 samples over 172 steps of 145 ms), 0.4% of every
        step for a figure a window of steps gives as well: the high-water mark spans the window."""
        self._steps = 0
        self.available = self._try(reset_peak)

    def step_done(self) -> None:
        if not self.available:
            return
        self._steps += 1
        if self.steady and self._steps < self.every:
            return
        self.steady.append(peak_bytes())
        reset_peak()
        self._steps = 0

    def recovery_started(self) -> None:
        """The recovery's window starts here: the failed step's partial work is not counted."""
        if self.available:
            reset_peak()

    def recovered(self) -> dict[str, Any]:
        """``peak_rss_ratio`` (None without a steady state: a spare, or a fault before the first
        step), both figures in MiB; then a new steady state starts (the new world's shards differ)."""
        peak = peak_bytes() if self.available else None
        steady = max(self.steady) if self.steady else None
        ratio = round(peak / steady, 3) if peak is not None and steady else None
        self.steady.clear()
        self._steps = 0
        self.recovery_started()
        return {"peak_rss_ratio": ratio, "peak_rss_mb": _mb(peak), "steady_rss_mb": _mb(steady)}

    @staticmethod
    def _try(probe: Any) -> bool:
        try:
            probe()
        except PeakUnavailable:
            return False
        return True
