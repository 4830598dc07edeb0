"""Authenticating chaos fault requests with the run token.

A fault request in etcd (``chaos/requests/<node>/<id>``) makes a node's agent kill its own
workers, corrupt its checkpoint or kill itself: it is a remote kill switch.  When the run has a
token (``security.token_env`` / ``token_file``), a request must carry an HMAC-SHA256 over its
canonical JSON, keyed by a key derived from the token; anyone who can write the run's keys but
does not hold the token cannot forge one.  The token itself never goes into etcd (the
admission record holds only its salted PBKDF2 hash, :mod:`elastic.control.admission`).

Replays are bounded two ways: a request names its run and node and carries a timestamp that must
be recent (``max_age_s``), and an id that the agent executes at most once (it records a result
under that id before or instead of acting).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from typing import Any

MAC_FIELD = "mac"
_DOMAIN = b"elastic-dit chaos fault request v1"


def _key(token: str) -> bytes:
    # A key of its own, so the MAC never reveals anything usable with the token elsewhere.
    return hmac.new(token.encode(), _DOMAIN, hashlib.sha256).digest()


def canonical(request: dict[str, Any]) -> bytes:
    """The bytes the MAC covers: every field but the MAC, sorted, compact."""
    body = {k: v for k, v in request.items() if k != MAC_FIELD}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), default=str).encode()


def sign(request: dict[str, Any], token: str | None) -> dict[str, Any]:
    """The request with its MAC when there is a token (unchanged when the run has none)."""
    if not token:
        return dict(request)
    return {**request, MAC_FIELD: hmac.new(_key(token), canonical(request), hashlib.sha256).hexdigest()}


def refusal(request: dict[str, Any], token: str | None, run_id: str, node_id: str, max_age_s: float,
            now: float | None = None) -> str | None:
    """Why this agent must not execute ``request``; None when it may."""
    if request.get("run_id") != run_id or request.get("node") != node_id:
        return f"request is for run {request.get('run_id')!r} node {request.get('node')!r}, not this node"
    ts = request.get("ts")
    now = time.time() if now is None else now
    if not isinstance(ts, (int, float)) or abs(now - ts) > max_age_s:
        return f"request timestamp {ts!r} is not within {max_age_s:g}s of now (stale or replayed)"
    if not token:
        return None
    mac = request.get(MAC_FIELD)
    if not isinstance(mac, str) or not mac:
        return "the run has a token and the request carries no MAC"
    expected = hmac.new(_key(token), canonical(request), hashlib.sha256).hexdigest()
    if not hmac.compare_digest(mac, expected):
        return "MAC does not verify with this run's token"
    return None
