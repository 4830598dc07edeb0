"""A warm spare that loses its first generation while it *builds* the model re-forms, as one that
loses it while restoring does (soak seed 2, 2026-12-05: a kill 0.5 s into a recovery tore the
joining spare's groups down under ``DiTRun.__init__``; ``mesh["dp"]`` raised "Default process group
has not been initialized", the spare exited 1 and its node fell back to disk: "no warm spare"), and
as one whose checkpoint group fails as its generation is torn (soak seed 3, 2026-12-06: ``new_group``
raised ``DistNetworkError``, same ending; tests/test_slot_faults_e2e.py has it end to end)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from elastic.worker.faultwatch import FaultLatch
from elastic.worker.session import WorkerSession

NO_PG = "Default process group has not been initialized, please make sure to call init_process_group."


def _session(joining: bool, torn: bool) -> WorkerSession:
    latch = FaultLatch(lambda: {})
    latch.forming(3)
    if torn:
        latch.teardown(3, {"gen": 3, "kind": "worker_died"})
    session = WorkerSession.__new__(WorkerSession)
    session.inproc = SimpleNamespace(joining=joining, latch=latch, hang_switch=False)
    session.checkpoints, session.ckpt = False, None
    session.recovered = []
    session._recover = lambda build, step, lost: session.recovered.append(lost) or ("rebuilt", 7)
    return session


def _build_torn_under_it(session: WorkerSession) -> None:
    raise ValueError(NO_PG)


def test_a_spare_whose_groups_are_torn_while_it_builds_re_forms():
    session = _session(joining=True, torn=True)
    assert session._start(_build_torn_under_it) == (7, "rebuilt")
    (lost,) = session.recovered
    assert "Default process group" in lost.error and lost.fault["kind"] == "worker_died"


def _group_torn_under_it() -> None:
    raise RuntimeError("[c10d] DistNetworkError: Failed to recv, got 0 bytes")


def test_a_spare_whose_checkpoint_group_fails_as_its_generation_is_torn_re_forms():
    session = _session(joining=True, torn=True)
    session.checkpoints, session._checkpoints = True, _group_torn_under_it
    assert session._start(lambda _s: pytest.fail("built before its checkpoint group")) == (7, "rebuilt")
    (lost,) = session.recovered
    assert "Failed to recv" in lost.error


@pytest.mark.parametrize("joining, torn", [(True, False), (False, True)])
def test_a_build_error_is_raised_unless_a_joining_spare_lost_its_generation(joining, torn):
    session = _session(joining=joining, torn=torn)
    with pytest.raises(ValueError, match="Default process group"):
        session._start(_build_torn_under_it)
    assert session.recovered == []
