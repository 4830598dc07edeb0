"""Process-tree helpers: own process groups, parent-death signals, tree kill.

torchrun starts each worker in a session of its own, so signalling torchrun's
process group does not reach the workers.  The agent therefore remembers the
whole tree below torchrun (read from /proc) and signals every member, and
every child it starts gets a parent-death signal so that nothing outlives a
SIGKILLed parent.
"""

from __future__ import annotations

import ctypes
import os
import signal
import time
from collections.abc import Iterable

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15


def set_parent_death_signal(sig: int = signal.SIGTERM) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent dies (Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def set_process_name(name: str) -> None:
    """Name this process for ``ps -e``, ``top`` and ``pgrep NAME`` (Linux keeps 15 bytes of it)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def child_preexec(sig: int = signal.SIGTERM):
    """``preexec_fn`` for Popen: parent-death signal (the new session comes from start_new_session)."""

    def _preexec() -> None:
        set_parent_death_signal(sig)

    return _preexec


def children(pid: int) -> list[int]:
    kids: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/children") as fh:
                    kids.extend(int(x) for x in fh.read().split())
            except OSError:
                continue
    except OSError:
        pass
    return kids


def descendants(pid: int) -> list[int]:
    """All live descendants of ``pid`` (breadth first)."""
    found: list[int] = []
    queue = [pid]
    while queue:
        for kid in children(queue.pop(0)):
            if kid not in found:
                found.append(kid)
                queue.append(kid)
    return found


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    except (OSError, IndexError):
        return False


def signal_all(pids: Iterable[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def terminate_tree(root_pid: int | None, known: Iterable[int] = (), grace: float = 5.0) -> None:
    """SIGTERM the tree (root + descendants + previously seen pids), then SIGKILL what remains."""
    pids = set(known)
    if root_pid is not None:
        pids.add(root_pid)
        pids.update(descendants(root_pid))
    pids = {p for p in pids if alive(p)}
    if not pids:
        return
    # A stopped (SIGSTOP) process never handles SIGTERM: continue it first.
    signal_all(pids, signal.SIGCONT)
    signal_all(pids, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if root_pid is not None:
            pids.update(p for p in descendants(root_pid))
        pids = {p for p in pids if alive(p)}
        if not pids:
            return
        time.sleep(0.05)
    signal_all(pids, signal.SIGKILL)


_PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Orphaned descendants are re-parented to this process instead of init (Linux), so it can reap
    and supervise the workers after retiring the torchrun that started them."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


UNKNOWN_EXIT = 255
"""The status of a child process that this agent cannot wait for (torchrun reaped it before it
retired): it ended, how is unknown; a failure, never a success."""


class NotOurChild(LookupError):
    """``waitpid`` says the pid is not a child of this process: its exit status is not ours to read."""


def reap(pid: int) -> int | None:
    """The exit status of a child that ended (negative: killed by that signal, as Popen reports it),
    None while it runs.  Raises :class:`NotOurChild` for a pid that is not (or no longer) our child:
    only ``waitpid`` tells how a process ended, so a pid we cannot wait for never reads as a success
    (a dead pid read as "exit 0" once made an agent declare its node finished mid-run)."""
    try:
        done, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        raise NotOurChild(pid) from None
    if done == 0:
        return None
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def reap_quietly(pid: int) -> None:
    """Collect a child's status after a kill, if it is ours (teardown: the status is not needed)."""
    try:
        reap(pid)
    except NotOurChild:
        pass
