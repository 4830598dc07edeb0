"""Who may join a run: the run token and the join fingerprint.

Both are recorded under the run prefix by the first agent that registers
(compare-and-swap on create, so concurrent first agents agree on one record)
and checked by every agent after it, before it touches the run's state:

* ``<prefix>/admission/token``: a salted PBKDF2 hash of the run token (never
  the token).  A node with another token, or without one when the run has one
  (or the reverse), is refused with :data:`EXIT_WRONG_TOKEN`: it belongs to
  another run that shares this etcd and run id.
* ``<prefix>/admission/fingerprint``: :func:`join_fingerprint` -- the run
  config minus per-node fields, and the hash of the project's code.  A node
  whose config or code differs is refused with :data:`EXIT_FINGERPRINT`
  (``security.join_check: warn`` only reports it, ``off`` skips the check).

Messages say *what* differs and never print a token or its hash.
"""

from __future__ import annotations

import copy
import hashlib
import hmac
import json
import os
import re
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from elastic.common.config import ConfigError
from elastic.control.etcd_security import read_secret_file
from elastic.common.fingerprint import code_hash, config_hash
from elastic.control.keys import RunKeys

EXIT_WRONG_TOKEN = 94
EXIT_FINGERPRINT = 95

# Fields that may differ between the nodes of one run: where this node keeps its files, its
# addresses (workers, metrics endpoint), how it reaches etcd, which credentials it holds,
# whether it executes chaos faults, rank 0's TensorBoard output, and the derived checkpoint fingerprint.
PER_NODE_FIELDS = ("run.dir", "launch.node_id", "launch.etcd_endpoint", "launch.local_addr",
                   "launch.respawn_excluded", "launch.standby", "agent.metrics", "agent.chaos", "tensorboard", "etcd", "security",
                   "fingerprint")

_PBKDF2_ITERATIONS = 100_000
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(kw_only=True)
class SecurityConfig:
    """The ``security:`` section: the run token (by reference only) and the join check."""

    token_env: str = ""
    """Name of the environment variable holding the run token (every node of the run must have the same)."""
    token_file: str = ""
    """File whose first line is the run token."""
    join_check: Literal["refuse", "warn", "off"] = "refuse"
    """A node whose config or code differs from the run's: refuse it (exit 95), only warn, or do not check."""

    def __post_init__(self) -> None:
        if self.token_env and self.token_file:
            raise ConfigError("token_env", "give token_env or token_file, not both")
        if self.token_env and not _ENV_NAME_RE.match(self.token_env):
            raise ConfigError("token_env", f"must be an environment variable name, got {self.token_env!r}")
        if self.token_file and not Path(self.token_file).is_file():
            raise ConfigError("token_file", f"no such file: {self.token_file}")

    def token(self, environ: Mapping[str, str] | None = None, path: str = "security") -> str | None:
        """The run token, None when none is configured; ConfigError naming the field if it cannot be read."""
        env = os.environ if environ is None else environ
        if self.token_env:
            value = env.get(self.token_env, "")
            if not value:
                raise ConfigError(f"{path}.token_env", f"environment variable {self.token_env} is not set or empty")
            return value
        if self.token_file:
            return read_secret_file(self.token_file, f"{path}.token_file")
        return None


def join_fingerprint(config: dict[str, Any]) -> dict[str, str]:
    """{"config": hash of the run config without :data:`PER_NODE_FIELDS`, "code": hash of the sources}."""
    basis = copy.deepcopy(config)
    for dotted in PER_NODE_FIELDS:
        *parents, leaf = dotted.split(".")
        node = basis
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(leaf, None)
    return {"config": config_hash(basis), "code": code_hash()}


def hash_token(token: str, salt: bytes) -> str:
    return hashlib.pbkdf2_hmac("sha256", token.encode(), salt, _PBKDF2_ITERATIONS).hex()


class Refused(Exception):
    """This node may not join the run; ``code`` is the agent's exit code."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, kw_only=True)
class Admission:
    """What this node presents when it joins: its run token (in memory only) and its join fingerprint."""

    run_id: str
    node_id: str
    token: str | None = field(default=None, repr=False)
    fingerprint: dict[str, str] = field(default_factory=dict)
    join_check: str = "refuse"

    def check(self, store: Any, keys: RunKeys, events: Any) -> None:
        """Record or verify the run's token and fingerprint; raise :class:`Refused` if this node may not join."""
        self._check_token(store, keys.admission_token, events)
        if self.join_check != "off":
            self._check_fingerprint(store, keys.admission_fingerprint, events)

    def _record_or_read(self, store: Any, key: str, fresh: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
        """Create the record (None: this node recorded it) or return the one already there."""
        kv = store.get(key)
        if kv is None:
            ok, kv = store.compare_and_swap(key, json.dumps(fresh()), 0)
            if ok:
                return None
        try:
            return json.loads(kv.value)
        except (json.JSONDecodeError, AttributeError):
            return {}

    def _check_token(self, store: Any, key: str, events: Any) -> None:
        def fresh() -> dict[str, Any]:
            salt = os.urandom(16)
            return {"scheme": f"pbkdf2-sha256-{_PBKDF2_ITERATIONS}", "salt": salt.hex(),
                    "hash": hash_token(self.token, salt) if self.token else "", "by": self.node_id, "ts": time.time()}

        record = self._record_or_read(store, key, fresh)
        if record is None:
            events.emit("agent.run_token_recorded", protected=bool(self.token))
            return
        expected = str(record.get("hash", ""))
        run = f"run {self.run_id}"
        if not expected:
            if self.token:
                raise Refused(EXIT_WRONG_TOKEN, f"{run} was started without a run token, but this node has one "
                                                f"(a node of another run?)")
            return
        if not self.token:
            raise Refused(EXIT_WRONG_TOKEN, f"{run} requires a run token and this node has none "
                                            f"(set security.token_env or security.token_file)")
        try:
            salt = bytes.fromhex(str(record.get("salt", "")))
        except ValueError:
            salt = b""
        if not hmac.compare_digest(hash_token(self.token, salt), expected):
            raise Refused(EXIT_WRONG_TOKEN, f"this node's run token does not match the one recorded for {run} "
                                            f"by {record.get('by')} (a node of another run?)")
        events.emit("agent.run_token_accepted")

    def _check_fingerprint(self, store: Any, key: str, events: Any) -> None:
        record = self._record_or_read(store, key, lambda: {**self.fingerprint, "by": self.node_id, "ts": time.time()})
        if record is None:
            events.emit("agent.fingerprint_recorded", **self.fingerprint)
            return
        differs = [name for name in ("config", "code") if record.get(name) != self.fingerprint.get(name)]
        if not differs:
            return
        what = " and ".join(differs)
        detail = ", ".join(f"{name} {self.fingerprint.get(name)} vs the run's {record.get(name)}" for name in differs)
        message = (f"this node's {what} differ{'s' if len(differs) == 1 else ''} from run {self.run_id}'s "
                   f"(recorded by {record.get('by')}): {detail}")
        events.emit("agent.fingerprint_mismatch", differs=differs, action=self.join_check, detail=detail)
        if self.join_check == "refuse":
            raise Refused(EXIT_FINGERPRINT, message + " (security.join_check: warn to allow)")
        print(f"elastic-agent: warning: node {self.node_id}: {message}", file=sys.stderr)
