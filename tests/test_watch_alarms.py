"""The watch's created-checks share one alarm thread per process (elastic/control/watch.py)."""

from __future__ import annotations

import threading
import time

from elastic.control.watch import _Alarms


def test_due_alarms_run_in_order_and_cancelled_ones_never_run():
    alarms, fired, done = _Alarms(), [], threading.Event()
    cancelled = [alarms.after(0.05, fired.append, f"x{i}") for i in range(50)]
    alarms.after(0.15, fired.append, "b")
    alarms.after(0.10, fired.append, "a")
    alarms.after(0.20, done.set)
    for entry in cancelled:
        alarms.cancel(entry)
    assert done.wait(5)
    assert fired == ["a", "b"]


def test_an_alarm_earlier_than_the_one_waited_for_wakes_the_thread():
    alarms, fired = _Alarms(), threading.Event()
    alarms.after(30.0, lambda: None)
    start = time.monotonic()
    alarms.after(0.05, fired.set)
    assert fired.wait(5) and time.monotonic() - start < 5


def test_a_failing_callback_does_not_stop_the_others():
    alarms, fired = _Alarms(), threading.Event()
    alarms.after(0.01, lambda: 1 / 0)
    alarms.after(0.02, fired.set)
    assert fired.wait(5)
