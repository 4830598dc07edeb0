"""The worker's heap freeze: frozen after a world's first steps, thawed before a re-formation."""

from __future__ import annotations

import gc
import weakref

from elastic.common.events import EventLog, read_events
from elastic.worker.heap import HeapFreeze


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_freezes_after_the_first_steps_without_freezing_garbage_and_thaws(tmp_path):
    events = EventLog(tmp_path / "e.jsonl", "test")
    heap = HeapFreeze(events, after_steps=2)
    try:
        heap.after_step(1)
        assert not heap.frozen and gc.get_freeze_count() == 0
        garbage = weakref.ref(_Cycle())  # only the collector can free it: collected, never frozen
        heap.after_step(2)
        assert heap.frozen and gc.get_freeze_count() > 0
        assert garbage() is None
        heap.after_step(3)  # frozen once
        frozen = [e for e in read_events([tmp_path / "e.jsonl"]) if e["kind"] == "trainer.heap_frozen"]
        assert [e["step"] for e in frozen] == [2] and frozen[0]["objects"] > 0
        heap.thaw()
        assert gc.get_freeze_count() == 0 and not heap.frozen
        heap.after_step(10)
        assert not heap.frozen  # a new world waits for its own first steps
    finally:
        gc.unfreeze()


def _frozen(objects: list) -> int:
    """How many of ``objects`` sit in the permanent generation (tracked, in none of gens 0-2)."""
    young = {id(o) for o in gc.get_objects()}
    return sum(gc.is_tracked(o) and id(o) not in young for o in objects)


def test_a_rebase_collects_the_old_world_and_freezes_what_outlives_it(tmp_path):
    """Mid-recovery: the old world's cycles are freed, the survivors frozen at once, and the new
    world's objects wait for its own first steps (whose collection then walks only them)."""
    heap = HeapFreeze(EventLog(tmp_path / "e.jsonl", "test"), after_steps=2)
    try:
        heap.after_step(1)
        heap.after_step(2)
        old_world = weakref.ref(_Cycle())
        survivor = _Cycle()
        heap.thaw()
        heap.rebase()
        assert old_world() is None and not heap.frozen
        assert gc.get_freeze_count() > 0 and _frozen([survivor]) == 1
        new_world = [_Cycle() for _ in range(50)]
        heap.after_step(3)
        assert not heap.frozen and _frozen(new_world) == 0
        heap.after_step(4)
        # Asked of the objects themselves: the freeze count also moves with any other thread of the
        # test process (a frozen object another thread frees leaves the count; CI saw 49 of 50).
        assert heap.frozen and _frozen(new_world) == len(new_world)
    finally:
        gc.unfreeze()


def test_an_idle_spare_freezes_its_imported_heap_but_never_once_it_took_a_slot(monkeypatch):
    from elastic.worker import spare

    monkeypatch.setattr(spare, "_assigned", False)
    try:
        garbage = weakref.ref(_Cycle())
        spare._freeze_idle_heap()
        assert garbage() is None and gc.get_freeze_count() > 0
        gc.unfreeze()
        spare._take_slot()
        spare._freeze_idle_heap()
        assert gc.get_freeze_count() == 0
    finally:
        gc.unfreeze()
