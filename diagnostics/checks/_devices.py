"""Which devices the benchmark checks run on, and the spec they are judged against."""

from __future__ import annotations

import time
from typing import Any

from diagnostics.thresholds import ModelSpec, Thresholds


def compute_devices() -> list[Any]:
    """Every visible CUDA device, or the CPU when there is none."""
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    return [torch.device("cpu")]


def spec_for(device: Any, thresholds: Thresholds) -> tuple[str, ModelSpec | None]:
    """(device model name, spec); the CPU spec for the CPU, None for an unknown GPU model."""
    import torch

    if device.type == "cpu":
        return "cpu", thresholds.cpu
    name = torch.cuda.get_device_name(device)
    return name, thresholds.model_for(name)


def synchronize(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cpu_expected(device: Any, floor: float | None, unscaled: float, scale: float) -> float | None:
    """What a CPU measurement is judged against when a throughput-scale knob is injected.

    A GPU has a peak to compare with, so ``tflops_scale: 0.3`` means "30 % of what it
    should do" and fails.  A CPU has only a floor; without this, the same knob would
    pass on a CPU host and chaos could not make a CPU node look slow.  So with a scale
    injected on the CPU, the host's own unscaled measurement is the expectation: the
    injected fraction is judged by the same warn / fail fractions, whatever the host's
    speed.  Not the floor where the host is below it: a loaded 2-core host measured bf16
    GEMM at half the CPU floor, and ``tflops_scale: 0.42`` (a warn) then failed
    (tests/test_diag_checks.py, a fresh suite); without a knob the floor judges as before.
    """
    if device.type != "cpu" or scale == 1.0:
        return floor
    return unscaled


def judge(measured: float, expected: float | None, warn_fraction: float, fail_fraction: float) -> tuple[str, str]:
    """(verdict, threshold text) for a throughput against ``expected``; pass when nothing is expected."""
    if expected is None:
        return "pass", "none"
    return _judge_lines(measured, expected * warn_fraction, expected * fail_fraction)


def _judge_lines(measured: float, warn: float, fail: float) -> tuple[str, str]:
    text = f">={warn:.4g} (fail<{fail:.4g})"
    if measured < fail:
        return "fail", text
    if measured < warn:
        return "warn", text
    return "pass", text


def judge_measurement(ctx: Any, check: str, key: str, model: str, measured: float, datasheet: float | None,
                      t: Any) -> tuple[str, str, str]:
    """(verdict, threshold text, source) of one throughput: against the calibration's median for
    (check, key, device model) when the screen has one, else ``datasheet`` x the fractions."""
    entry = ctx.calibration.entry(check, key, model) if ctx.calibration is not None else None
    if entry is not None:
        warn, fail = entry.lines(t.calibrated_warn_fraction, t.calibrated_fail_fraction)
        verdict, text = _judge_lines(measured, warn, fail)
        return verdict, f"{text} calibrated", "calibration"
    verdict, text = judge(measured, datasheet, t.warn_fraction, t.fail_fraction)
    return verdict, text, "datasheet" if datasheet is not None else "none"


class DeviceTimer:
    """Elapsed seconds on one device: CUDA events on its stream (device time, not host time
    around asynchronous launches); on the CPU the host clock, or with ``thread_cpu`` the calling
    thread's own CPU time.

    ``thread_cpu`` is for compute run on the calling thread (:class:`single_cpu_thread`): a core
    shared with other processes -- the worker's own start, or every simulated node of a local run
    on the same cores -- then reads as fewer iterations, not as a slow node.  :attr:`cpu_share`
    says how much of the wall time the thread had.  Not for collectives (gloo works on threads
    of its own, and waiting for a peer is part of what they measure).
    """

    def __init__(self, device: Any, thread_cpu: bool = False) -> None:
        import torch

        self.cuda = device.type == "cuda"
        if self.cuda:
            with torch.cuda.device(device):
                self.start_event = torch.cuda.Event(enable_timing=True)
                self.end_event = torch.cuda.Event(enable_timing=True)
        self.device = device
        self.thread_cpu = thread_cpu and not self.cuda
        self.t0 = self.t1 = self.c0 = self.c1 = 0.0

    def start(self) -> None:
        import torch

        if self.cuda:
            with torch.cuda.device(self.device):
                self.start_event.record()
        self.t0, self.c0 = time.perf_counter(), time.thread_time()

    def stop(self) -> None:
        import torch

        if self.cuda:
            with torch.cuda.device(self.device):
                self.end_event.record()
        self.t1, self.c1 = time.perf_counter(), time.thread_time()

    def seconds(self) -> float:
        """After the device is synchronised."""
        if self.cuda:
            return self.start_event.elapsed_time(self.end_event) / 1e3
        if self.thread_cpu:
            return max(self.c1 - self.c0, 1e-9)
        return self.t1 - self.t0

    @property
    def cpu_share(self) -> float | None:
        """Of the timed wall time, the fraction this thread ran (None on a GPU)."""
        if self.cuda:
            return None
        return round(min((self.c1 - self.c0) / max(self.t1 - self.t0, 1e-9), 1.0), 3)


class single_cpu_thread:
    """Run a CPU benchmark on one intra-op thread, restoring the previous setting.

    On a shared or oversubscribed host, OpenMP's spinning barriers make a
    multi-threaded small GEMM several times slower than a single thread
    (measured 5x at load 5 on 2 cores), which would make the CPU floors
    meaningless; one thread gives a stable floor.  No effect on CUDA devices.
    """

    def __init__(self, device: Any) -> None:
        self.device = device
        self.prev: int | None = None

    def __enter__(self) -> None:
        import torch

        if self.device.type == "cpu":
            self.prev = torch.get_num_threads()
            torch.set_num_threads(1)

    def __exit__(self, *exc: object) -> None:
        import torch

        if self.prev is not None:
            torch.set_num_threads(self.prev)
