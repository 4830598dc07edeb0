"""Peak RSS of a process (elastic.worker.memwatch): a buffer raises the peak, a reset brings it back."""

from __future__ import annotations

import pytest

from elastic.worker import memwatch
from elastic.worker.memwatch import PeakUnavailable, RecoveryPeak, peak_bytes, reset_peak, rss_bytes

BUFFER = 64 << 20
"""Far above what the interpreter allocates on its own between two reads (a few MiB at most)."""


def _touch(nbytes: int) -> bytearray:
    return bytearray(b"\x01" * nbytes)  # written: every page is resident


def _available() -> bool:
    try:
        reset_peak()
    except PeakUnavailable:
        return False
    return True


needs_proc = pytest.mark.skipif(not _available(), reason="no writable /proc/self/clear_refs (not Linux?)")


@needs_proc
def test_a_buffer_raises_the_peak_and_a_reset_brings_it_back_to_the_rss():
    reset_peak()
    before = peak_bytes()
    buf = _touch(BUFFER)
    assert peak_bytes() >= before + BUFFER * 0.9
    del buf
    reset_peak()
    assert peak_bytes() < before + BUFFER * 0.5  # the freed buffer no longer counts
    assert abs(peak_bytes() - rss_bytes()) < BUFFER * 0.5


@needs_proc
def test_recovery_peak_is_the_recovery_window_over_the_steady_steps():
    watch = RecoveryPeak(steady_steps=3)
    for _ in range(4):
        watch.step_done()
    watch.recovery_started()
    buf = _touch(4 * BUFFER)
    del buf
    fields = watch.recovered()
    assert fields["peak_rss_mb"] >= fields["steady_rss_mb"] + 4 * BUFFER / 2**20 * 0.9
    assert fields["peak_rss_ratio"] == pytest.approx(fields["peak_rss_mb"] / fields["steady_rss_mb"], rel=0.01)
    assert watch.recovered()["peak_rss_ratio"] is None  # a new world: no steady state yet


def test_without_proc_the_watch_is_inert(monkeypatch):
    monkeypatch.setattr(memwatch, "CLEAR_REFS", "/nonexistent/clear_refs")
    monkeypatch.setattr(memwatch, "STATUS", "/nonexistent/status")
    with pytest.raises(PeakUnavailable):
        peak_bytes()
    watch = RecoveryPeak()
    watch.step_done()
    watch.recovery_started()
    assert not watch.available
    assert watch.recovered() == {"peak_rss_ratio": None, "peak_rss_mb": None, "steady_rss_mb": None}


@needs_proc
def test_the_steady_state_is_read_once_per_window_and_the_window_keeps_its_peak(monkeypatch):
    reads = []
    monkeypatch.setattr(memwatch, "peak_bytes", lambda: reads.append(1) or memwatch._status_bytes("VmHWM"))
    watch = RecoveryPeak(steady_steps=2, every=10)
    watch.step_done()  # the first window is one step: a fault right after a start has a steady state
    assert len(reads) == 1
    buf = _touch(4 * BUFFER)  # a spike mid-window, freed before the window closes
    del buf
    for _ in range(9):
        watch.step_done()
    assert len(reads) == 1
    watch.step_done()
    assert len(reads) == 2
    assert watch.steady[-1] >= watch.steady[0] + 4 * BUFFER * 0.9  # the window's peak held the spike
