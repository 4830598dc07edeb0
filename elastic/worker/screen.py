"""The node screen inside the first worker: run while the worker starts, hold back only its first step.

The node agent hands the screen's spec to local rank 0 of its workers (``ELASTIC_SCREEN``, JSON).
The screen itself is a plugin (entry-point group ``elastic.screens``; the ``diag`` one is
:func:`diagnostics.preflight.screen_in_worker`): the runtime does not import the diagnostics.  It
runs on a background thread while the worker builds its model, joins its process group and loads
its checkpoint, and :meth:`BackgroundScreen.verdict` waits for it before the first step.  A node
that fails never trains a step: its worker reports the verdict and leaves, and its agent excludes
the node.  The screen pays no second ``import torch``, which on a host of several nodes was most
of its cost as a separate process.
"""

from __future__ import annotations

import json
import os
import threading
import time
from importlib.metadata import entry_points
from typing import Any

from elastic.common.env import SCREEN_ENV

GROUP = "elastic.screens"


class BackgroundScreen:
    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self._result: dict[str, Any] | None = None
        self._thread = threading.Thread(target=self._run, name="node-screen", daemon=True)
        self._thread.start()

    @classmethod
    def from_env(cls, local_rank: int) -> BackgroundScreen | None:
        """Local rank 0's screen, started now beside the worker's start.

        On a GPU host it loads other devices than the start does.  On a CPU host it shares the
        start's cores; the ``diag`` screen times its CPU measurements by its thread's own CPU time,
        so the share it gets reads as fewer iterations, not as a slow node (measured: with four
        busy processes on two cores it had 32-48% of a core and read within 10% of a quiet run).
        It used to run at the first step's gate on a CPU host, which cost the gate 0.5-0.9 s with
        four simulated nodes on two cores."""
        raw = os.environ.get(SCREEN_ENV, "")
        return cls(json.loads(raw)) if raw and local_rank == 0 else None

    def _run(self) -> None:
        name = self.spec.get("impl", "diag")
        try:
            screen = next(ep for ep in entry_points(group=GROUP) if ep.name == name).load()
            self._result = dict(screen(self.spec))
        except StopIteration:
            self._result = {"passed": False, "reason": f"no screen named {name!r} is installed ({GROUP})"}
        except Exception as exc:  # a screen that cannot run is a failed screen, with its reason
            self._result = {"passed": False, "reason": f"screen error: {type(exc).__name__}: {exc}"[:500]}

    def verdict(self) -> dict[str, Any]:
        """Block until the screen is done; {passed, reason, duration_s, wait_s}."""
        t0 = time.monotonic()
        self._thread.join()
        assert self._result is not None
        return {**self._result, "wait_s": round(time.monotonic() - t0, 3), "report": self.spec.get("report", "")}
