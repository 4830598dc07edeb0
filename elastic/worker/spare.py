"""A warm spare: a worker process with torch and the trainer imported, waiting to take a dead worker's slot.

    python -m elastic.worker.spare -m trainer.dit_train --config FILE --run-dir DIR

The node agent starts one per node once training runs.  It imports torch and the trainer module
(what costs seconds at a cold start), then blocks on a line of JSON on stdin.  A line
``{"verify": PATH}`` asks it to replay a check of replay verification (:mod:`elastic.sdc.replay`;
the trainer module names where its ``replay_gradients`` lives in ``REPLAY_MODULE``; ``"arbiter":
true``: a second replay of a check whose first replay disagreed), after which it waits again; any other line is the environment of the slot it takes (``LOCAL_RANK``, the agent's ``ELASTIC_*`` variables, ``ELASTIC_JOIN_GEN``: the
generation to join).  It then runs the trainer's ``main`` exactly as torchrun would, and the
worker session joins the world in-process (:mod:`elastic.worker.inprocess`).  End of input
without an assignment means the agent no longer needs it: it exits 0.

The module name comes from the command line, so the runtime does not import any trainer by name.
Replacement spares are forked from the node's zygote (:mod:`elastic.worker.zygote`: the same
command line, with ``ELASTIC_SPARE_ZYGOTE_FD`` set), which runs :func:`serve` in each fork.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from elastic.common.procs import set_parent_death_signal
from elastic.worker.zygote import ZYGOTE_FD_ENV, run_zygote


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 2 or args[0] != "-m":
        print("usage: python -m elastic.worker.spare -m MODULE [trainer args...]", file=sys.stderr)
        return 2
    # The spare is the agent's child: it goes when the agent goes.
    set_parent_death_signal(signal.SIGKILL)
    zygote_fd = os.environ.pop(ZYGOTE_FD_ENV, "")
    if zygote_fd:  # the node's spare zygote: it forks the spares
        return run_zygote(int(zygote_fd), args[1], args[2:])
    t0 = time.monotonic()
    import torch  # noqa: F401  (the point of a warm spare: this import is already paid when it is needed)

    return serve(importlib.import_module(args[1]), args[2:], t0)


def serve(module: ModuleType, argv: list[str], t0: float, forked_from: int | None = None) -> int:
    """A spare's life once the trainer is imported: say so, wait for a line, take a slot (never
    returns then) or replay checks until the input ends (0).  ``forked_from``: the zygote it was
    forked from (``elastic.worker.zygote``), for its "ready" line."""
    origin = {"forked_from": forked_from} if forked_from else {}
    print(json.dumps({"spare": "ready", "pid": os.getpid(), "import_s": round(time.monotonic() - t0, 3),
                      "ts": time.time(), **origin}), flush=True)
    # FSDP2's first DTensor op imports torch._dynamo (sharding propagation): 0.9 s of a spare's
    # 1.2 s from its assignment to joining the generation (cProfile of a DiT spare, 4 local nodes).
    # In a thread after "ready": an assignment that comes first is not held back by it (the
    # trainer's own import of it then waits on the import lock, never imports twice).
    threading.Thread(target=_warm, args=(t0, module, argv), name="warm-dynamo", daemon=True).start()
    while True:
        line = sys.stdin.readline()
        if not line.strip():
            return 0
        assignment = json.loads(line)
        if "verify" not in assignment:
            break
        verify_niced(module, argv, Path(assignment["verify"]), arbiter=bool(assignment.get("arbiter")))
    _take_slot()
    os.environ.update({str(k): str(v) for k, v in assignment["env"].items()})
    print(json.dumps({"spare": "assigned", "slot": assignment.get("slot"), "gen": assignment["env"].get("ELASTIC_JOIN_GEN"),
                      "wait_s": round(time.monotonic() - t0, 3)}), flush=True)
    code = int(module.main(argv) or 0)
    # Leave as a torchrun-started worker does (session.exit_process), never through interpreter
    # teardown: a spare that took a slot holds the process groups of every generation it joined,
    # and their C++ threads' destructors aborted one at exit ("terminate called without an active
    # exception", SIGABRT after the run's final step): its agent counted a crash, replaced it, and
    # the lemon policy excluded a healthy node (tests/test_inprocess_e2e.py, once in a full run).
    from elastic.worker.session import exit_process

    exit_process(code)
    return code  # not reached


def verify_niced(module: ModuleType, argv: list[str], path: Path, arbiter: bool = False) -> None:
    """:func:`verify` in a thread at ``OFF_PATH_NICE`` (Linux niceness is per thread), so the
    check's replay takes the CPU the training ranks leave idle (their step sleeps, their waits in
    collectives) instead of competing with them: with one intra-op thread, as the agent starts ranks
    and the replay matches (``torch.set_num_threads`` of the rank), the whole replay runs on it.  An
    arbiter's replay runs at normal priority: a verdict is waited for, and it is rare.  The main
    thread stays at normal priority for the slot the spare may take."""
    if arbiter:
        return verify(module, argv, path, arbiter)
    thread = threading.Thread(target=_niced, args=(verify, module, argv, path), name="replay", daemon=True)
    thread.start()
    thread.join()
    return None


def _niced(target: Callable[..., None], *args: Any) -> None:
    from elastic.sdc.results import nice_this_thread

    nice_this_thread()
    target(*args)


def verify(module: ModuleType, argv: list[str], path: Path, arbiter: bool = False) -> None:
    """Replay one check (``sdc.replay_every``) and leave the result beside its input for the agent:
    ``<input>.replayed.json`` (``.arbitrated.json`` for an arbiter): checksums, or the error that
    stopped the replay."""
    from elastic.sdc.replay import replay
    from elastic.sdc.results import write_result

    try:
        replay_module = importlib.import_module(getattr(module, "REPLAY_MODULE", module.__name__))
        result = replay(path, lambda record: replay_module.replay_gradients(argv, record),
                        corrupt=_replay_flip(path)).record()
    except Exception as exc:  # noqa: BLE001 - any failure is the check's result, never the spare's end
        result = {"error": f"{type(exc).__name__}: {exc}"}
    write_result(path, result, arbiter)
    print(json.dumps({"spare": "verified", "path": str(path), "arbiter": arbiter, **result}), flush=True)


def _replay_flip(path: Path):  # noqa: ANN202 - torch types stay out of this module's import
    """The chaos fault ``sdc`` at ``replay``: this node's spare computes one replay wrong (a verifier
    on a bad GPU), so the arbitration has to clear the checked rank.  The fault files live in the
    run directory the check's input is in (``<run>/sdc/<input>``)."""
    from elastic.sdc.flip import flip_bit
    from elastic.worker.faults import FaultHooks

    hooks = FaultHooks(path.parent.parent, rank=-1)

    def corrupt(step: int, grads: dict) -> None:
        fault = hooks.sdc(step, at="replay")
        if fault is None:
            return
        name, grad = next((n, g) for n, g in grads.items() if g is not None and g.numel())
        flip = flip_bit(grad, int(grad.detach().view(-1).abs().argmax()))
        hooks.sdc_fired(fault, step, {**flip.record(), "param": name, "at": "replay"})

    return corrupt


def _warm(t0: float, module: ModuleType, argv: list[str]) -> None:
    """Import torch._dynamo (and the trainer's replay module, with what it caches for a replay),
    then say so: until then the spare still takes CPU from the node's workers
    (``benchmarks/recovery.py`` measures steady-state step times only after every "warm")."""
    importlib.import_module("torch._dynamo")
    replay_module = getattr(module, "REPLAY_MODULE", "")
    try:
        warm = getattr(importlib.import_module(replay_module), "warm", None) if replay_module else None
        if warm is not None:
            warm(argv)
    except Exception as exc:  # noqa: BLE001 - a replay will fail and say why; the spare still takes slots
        print(json.dumps({"spare": "replay_warm_failed", "error": f"{type(exc).__name__}: {exc}"}), flush=True)
    _freeze_idle_heap()
    print(json.dumps({"spare": "warm", "warm_s": round(time.monotonic() - t0, 3), "ts": time.time()}), flush=True)


_assignment = threading.Lock()
_assigned = False


def _freeze_idle_heap() -> None:
    """Collect once and freeze the imported heap while the spare waits: the worker it becomes then
    freezes, after its first steps, only the objects of its world (``elastic.worker.heap``).  Why:
    that freeze walked the whole heap, ~360k objects, 0.28-0.32 s of a joined spare's steps on a
    loaded host, while a survivor's, frozen in its recovery, took 0.05-0.10 s.  Never once the slot
    is taken: the trainer's own objects are that freeze's to judge."""
    gc.collect()
    with _assignment:
        if not _assigned:
            gc.freeze()


def _take_slot() -> None:
    global _assigned
    with _assignment:
        _assigned = True


if __name__ == "__main__":
    sys.exit(main())
