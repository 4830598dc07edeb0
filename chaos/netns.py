"""Network partitions on one machine: every node in a network namespace of its own.

There is no second host here, but network namespaces and veth pairs work (as root, with ``ip``).
:class:`NetLab` builds a small virtual LAN that only this tool's processes use:

* a *switch* namespace holding a bridge at ``10.213.0.1/24``;
* per node a namespace with one interface ``eth0`` at ``10.213.0.<10+i>``, joined to the bridge
  by a veth pair whose switch-side end is ``v<i>``.

Nodes run inside their namespace (``nsenter --net=...``), reach each other over the bridge and
reach etcd through an :class:`~chaos.etcd_proxy.EtcdProxy` whose listening socket this module
opens inside the switch namespace (etcd itself stays on this host's loopback).  Partitioning
node i takes ``v<i>`` down: the node loses etcd and every peer at once, with no RST (packets
just go nowhere, as on a real cable pull); healing brings it up again.

Only namespaces this object created are touched, and every address lives inside them; ``close``
deletes them all.  :func:`available` says whether this host allows any of it.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import shutil
import socket
import subprocess
import threading

SUBNET = "10.213.0"
GATEWAY = f"{SUBNET}.1"
NODE_IFNAME = "eth0"
_CLONE_NEWNET = 0x40000000
_SERIAL = itertools.count()


class NetLabError(RuntimeError):
    """Namespaces could not be set up (not root, no ``ip``, or the kernel refused)."""


def available() -> str | None:
    """None when namespaces can be used here; otherwise why not (for a skip or an error message)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "nsenter"):
        if shutil.which(tool) is None:
            return f"no `{tool}` on PATH (apt-get install iproute2 util-linux)"
    return None


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise NetLabError(f"ip {' '.join(args)}: {proc.stderr.strip() or proc.returncode}")


class NetLab:
    def __init__(self, num_nodes: int, tag: str | None = None) -> None:
        why = available()
        if why:
            raise NetLabError(why)
        self.tag = tag or f"{os.getpid() % 100000}x{next(_SERIAL)}"  # unique per lab of this process
        self.switch = f"ch{self.tag}sw"
        self.nodes = [f"ch{self.tag}n{i}" for i in range(num_nodes)]
        self._made: list[str] = []

    # -- addresses ------------------------------------------------------------------
    @staticmethod
    def address(index: int) -> str:
        return f"{SUBNET}.{10 + index}"

    def wrap(self, index: int, argv: list[str]) -> list[str]:
        """``argv`` run inside node ``index``'s namespace."""
        return ["nsenter", f"--net=/run/netns/{self.nodes[index]}", "--", *argv]

    # -- life -----------------------------------------------------------------------
    def create(self) -> NetLab:
        try:
            self._add(self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "addr", "add", f"{GATEWAY}/24", "dev", "br0")
            for dev in ("lo", "br0"):
                _ip("-n", self.switch, "link", "set", dev, "up")
            for i, name in enumerate(self.nodes):
                self._add_node(i, name)
        except (NetLabError, OSError, subprocess.TimeoutExpired):
            self.close()
            raise
        return self

    def _add(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)

    def _add_node(self, i: int, name: str) -> None:
        self._add(name)
        _ip("link", "add", f"v{i}", "netns", self.switch, "type", "veth", "peer", "name", NODE_IFNAME,
            "netns", name)
        _ip("-n", self.switch, "link", "set", f"v{i}", "master", "br0")
        _ip("-n", self.switch, "link", "set", f"v{i}", "up")
        _ip("-n", name, "addr", "add", f"{self.address(i)}/24", "dev", NODE_IFNAME)
        for dev in ("lo", NODE_IFNAME):
            _ip("-n", name, "link", "set", dev, "up")

    def partition(self, index: int) -> None:
        _ip("-n", self.switch, "link", "set", f"v{index}", "down")

    def heal(self, index: int) -> None:
        _ip("-n", self.switch, "link", "set", f"v{index}", "up")

    def close(self) -> None:
        for name in reversed(self._made):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
        self._made.clear()

    # -- a listening socket on the bridge ------------------------------------------------
    def listener(self, port: int = 0) -> socket.socket:
        """A TCP socket listening at ``GATEWAY:port`` inside the switch namespace (port 0: any free one).

        setns() moves only the calling thread, so a short-lived thread enters the namespace, makes
        the socket and ends; the socket stays in the namespace it was made in.
        """
        box: dict[str, object] = {}
        thread = threading.Thread(target=self._listen_in_switch, args=(port, box), daemon=True)
        thread.start()
        thread.join(timeout=10)
        if "sock" not in box:
            raise NetLabError(f"could not listen in {self.switch}: {box.get('error', 'timed out')}")
        return box["sock"]  # type: ignore[return-value]

    def _listen_in_switch(self, port: int, box: dict[str, object]) -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            with open(f"/run/netns/{self.switch}") as fh:
                if libc.setns(fh.fileno(), _CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), "setns failed")
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((GATEWAY, port))
            sock.listen(256)
            box["sock"] = sock
        except OSError as exc:
            box["error"] = str(exc)
