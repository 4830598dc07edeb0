"""The spare zygote: one process per node with torch and the trainer imported, forking warm spares.

Why: a spare killed while it waits is replaced by a new process that imports torch and the trainer
again, ~5 s on a loaded 2-core host (4 local nodes).  A worker lost in those seconds found its
node's spare still importing: the costliest recoveries of the 10-minute soaks (2.6-4.8 s for a
spare kill followed by a worker kill 2 s later, against ~1.2 s for a worker kill with a warm
spare).  A fork of a process that has imported everything is ready in milliseconds.

How (the agent's side is :mod:`elastic.agent.sparefork`):

* The agent starts ``python -m elastic.worker.spare -m MODULE ...`` with ``ELASTIC_SPARE_ZYGOTE_FD``
  naming one end of a ``SOCK_SEQPACKET`` pair: :func:`elastic.worker.spare.main` comes here instead
  of waiting for a slot.  Its command line is a spare's, so whatever finds spares by it (chaos's
  ``kill_spare``) finds the forked ones alike.
* The imports run in a thread at ``OFF_PATH_NICE`` (niceness is per thread on Linux): the zygote
  takes the CPU the training ranks leave idle; the main thread, which forks, keeps the normal
  priority, and so do the spares it forks.
* It forks only while it has one thread: a fork copies the calling thread only, and a lock held
  by another thread at that moment would stay held in the child forever.  Nor once CUDA is
  initialised: a CUDA context does not survive a fork (each spare makes its own after its
  assignment, as a started one does).  A zygote with more threads or a CUDA context after its
  imports says ``unforkable`` and the agent starts spares as before.
* The imported heap is collected and frozen (``gc.freeze``) before the first fork: a child's
  collections then never touch (and so never copy) the pages it shares with the zygote.
* A request carries the spare's environment and two descriptors (``SCM_RIGHTS``): the read end of
  the pipe that is the spare's stdin, and its log.  The zygote forks twice; the middle process exits
  at once, so the spare is re-parented to the agent (a child subreaper: ``become_subreaper``), whose
  ``waitpid`` alone then reads how it ended, as for a spare it started itself.  The spare waits
  until it is the agent's child before it sets its parent-death signal (``PR_SET_PDEATHSIG`` fires
  when the *current* parent exits: set earlier, the middle process's exit would kill it).
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import signal
import socket
import sys
import threading
import time
from types import ModuleType
from typing import Any

ZYGOTE_FD_ENV = "ELASTIC_SPARE_ZYGOTE_FD"
"""The zygote's end of the agent's socket pair (set only in the zygote's environment)."""
REPARENT_TIMEOUT_S = 5.0
"""How long a forked spare waits to become the agent's child (the middle process exits at once)."""
EXIT_ORPHANED = 70
"""A forked spare whose agent was gone (or not a subreaper) by the time it was re-parented."""
_MAX_REQUEST = 1 << 20


def run_zygote(fd: int, module_name: str, argv: list[str]) -> int:
    """Import, then fork one spare per request until the agent closes its end (exit 0)."""
    from elastic.common.procs import set_process_name

    set_process_name("spare-zygote")
    sock = socket.socket(fileno=fd)
    t0 = time.monotonic()
    module = _import_niced(module_name)
    gc.collect()
    gc.freeze()
    threads, cuda = thread_count(), _cuda_initialized()
    state = "ready" if threads == 1 and not cuda else "unforkable"
    _send(sock, {"zygote": state, "pid": os.getpid(), "threads": threads, "cuda_initialized": cuda,
                 "import_s": round(time.monotonic() - t0, 3)})
    if state != "ready":
        return 3
    while True:
        msg, fds, _, _ = socket.recv_fds(sock, _MAX_REQUEST, 2)
        if not msg:
            return 0
        _send(sock, _serve_one(sock, module, argv, json.loads(msg), fds))


def thread_count() -> int:
    """Threads of this process, the native ones included (``/proc/self/task``)."""
    return len(os.listdir("/proc/self/task"))


def _cuda_initialized() -> bool:
    """A CUDA context does not survive a fork (the child's first CUDA call fails): the trainer's
    import must not have made one, and the zygote never forks if it did."""
    import torch

    return bool(torch.cuda.is_initialized())


def _import_niced(module_name: str) -> ModuleType:
    """torch, the trainer, ``torch._dynamo`` (FSDP2's first DTensor op imports it) and the trainer's
    replay module, in a niced thread that ends before the first fork."""
    out: dict[str, Any] = {}

    def work() -> None:
        from elastic.sdc.results import nice_this_thread

        nice_this_thread()
        try:
            import torch  # noqa: F401  (what the zygote is for)

            out["module"] = module = importlib.import_module(module_name)
            importlib.import_module("torch._dynamo")
            replay = getattr(module, "REPLAY_MODULE", "")
            if replay:
                importlib.import_module(replay)
        except BaseException as exc:  # noqa: BLE001 - raised again in the main thread
            out["error"] = exc

    thread = threading.Thread(target=work, name="zygote-import")
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["module"]


def _send(sock: socket.socket, record: dict[str, Any]) -> None:
    sock.send(json.dumps(record).encode())


def _serve_one(sock: socket.socket, module: ModuleType, argv: list[str], request: dict[str, Any],
               fds: list[int]) -> dict[str, Any]:
    """One fork: the spare's pid once it is the agent's to wait for, or why there is none."""
    try:
        if len(fds) != 2:
            return {"error": f"a fork request needs 2 descriptors (stdin, log), got {len(fds)}"}
        sys.stdout.flush()
        sys.stderr.flush()
        return {"pid": _double_fork(sock, module, argv, request, fds)}
    except OSError as exc:
        return {"error": f"fork: {exc}"}
    finally:
        for fd in fds:
            os.close(fd)


def _double_fork(sock: socket.socket, module: ModuleType, argv: list[str], request: dict[str, Any],
                 fds: list[int]) -> int:
    agent, zygote = os.getppid(), os.getpid()
    r, w = os.pipe()
    middle = os.fork()
    if middle == 0:  # the middle process: fork the spare, say its pid, leave at once
        code = 0
        try:
            os.close(r)
            spare = os.fork()
            if spare == 0:
                os.close(w)
                _become_spare(sock, module, argv, request, fds, (agent, zygote))  # never returns
            os.write(w, str(spare).encode())
        except BaseException:  # noqa: BLE001 - the zygote reads no pid and says so
            code = 1
        os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as pipe:
        pid = pipe.read()
    os.waitpid(middle, 0)
    if not pid:
        raise OSError("the middle process could not fork the spare")
    return int(pid)


def _become_spare(sock: socket.socket, module: ModuleType, argv: list[str], request: dict[str, Any],
                  fds: list[int], parents: tuple[int, int]) -> None:
    """In the forked spare: its own session, stdio and environment, the agent as its parent, then a
    spare's life (:func:`elastic.worker.spare.serve`)."""
    code = EXIT_ORPHANED
    agent, zygote = parents
    try:
        from elastic.common.procs import set_process_name

        set_process_name("python")  # a started spare's name, not the zygote's (ps, top)
        sock.close()
        os.setsid()
        stdin, log = fds
        os.dup2(stdin, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(stdin)
        os.close(log)
        os.environ.clear()
        os.environ.update({str(k): str(v) for k, v in request.get("env", {}).items()})
        if _adopted_by(agent):
            from elastic.worker.spare import serve

            code = serve(module, argv, time.monotonic(), forked_from=zygote)
    except BaseException as exc:  # noqa: BLE001 - a spare that cannot start says why in its log, and exits
        print(json.dumps({"spare": "fork_failed", "error": f"{type(exc).__name__}: {exc}"}), flush=True)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _adopted_by(agent: int) -> bool:
    """Wait until the middle process is gone and ``agent`` is this process's parent, then die with
    it (as a spare the agent started does)."""
    from elastic.common.procs import set_parent_death_signal

    deadline = time.monotonic() + REPARENT_TIMEOUT_S
    while os.getppid() != agent and time.monotonic() < deadline:
        time.sleep(0.001)
    set_parent_death_signal(signal.SIGKILL)
    if os.getppid() == agent:
        return True
    print(json.dumps({"spare": "orphaned", "parent": os.getppid(), "agent": agent}), flush=True)
    return False
