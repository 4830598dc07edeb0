"""One etcd member's JSON gateway for unary requests, on urllib3 directly.

Why not etcd3gw's ``Etcd3Client.post`` (requests underneath), which the store used before: per
request requests merges settings, builds cookie jars and checks headers against runtime protocols,
and a new session reads the whole environment for proxies.  Measured on this host against a local
etcd, one thread, ``get`` of one key: the store over etcd3gw 0.60 ms of CPU a request, this client
0.36 ms (urllib3 bare 0.24, ``http.client`` bare 0.15 ms).  Under a
rendezvous of 2,048 participants the clients' CPU was most of the host's (the participants share
two cores with etcd), and making a session per participant thread cost as much as its requests.

Watch streams (:mod:`elastic.control.watch`) use it too (:meth:`UnaryClient.stream`): in the
2,048-participant rendezvous, opening each waiter's stream through a requests session was two thirds
of the participant processes' CPU samples (py-spy).

Errors are etcd3gw's, raised as etcd3gw raises them, so the store's retry and error typing stay
one code path: a timeout is ``ConnectionTimeoutError``, a refused or broken connection (TLS
included, the urllib3 error kept as the cause) ``ConnectionFailedError``, an HTTP status other
than 200 the same exception etcd3gw maps it to, with the body as ``detail_text``.
"""

from __future__ import annotations

import http.client
import json
import os
from collections.abc import Callable
from typing import Any

import certifi
import urllib3
from etcd3gw import exceptions as gw_exc

from elastic.control.etcd_security import EtcdSecurity, environ_proxy

_BY_STATUS: dict[int, type[gw_exc.Etcd3Exception]] = {
    500: gw_exc.InternalServerError,
    503: gw_exc.ConnectionFailedError,
    408: gw_exc.ConnectionTimeoutError,
    504: gw_exc.ConnectionTimeoutError,
    412: gw_exc.PreconditionFailedError,
}
"""etcd3gw's mapping of HTTP statuses to its exceptions (``etcd3gw.client._EXCEPTIONS_BY_CODE``)."""

_JSON = {"Content-Type": "application/json", "Accept": "*/*"}
"""``Accept`` as requests sends it: etcd's gateway answers an unauthenticated request without it
"permission denied" instead of "user name is empty" (measured, etcd 3.5, client-cert TLS), and
the store names the missing setting from the latter."""


def _ca_bundle(security: EtcdSecurity) -> str:
    """The CA file to verify a TLS member against: the run's, else what requests would use."""
    return (security.ca_file or os.environ.get("REQUESTS_CA_BUNDLE") or os.environ.get("CURL_CA_BUNDLE")
            or certifi.where())


def _pool_manager(base_url: str, security: EtcdSecurity) -> urllib3.PoolManager:
    tls: dict[str, Any] = {}
    if security.tls:
        tls = {"cert_reqs": "CERT_REQUIRED", "ca_certs": _ca_bundle(security)}
        if security.cert_file:
            tls.update(cert_file=security.cert_file, key_file=security.key_file or None)
    # One connection: a client serves one thread at a time (the store pools clients, not sockets).
    options = dict(num_pools=2, maxsize=1, block=False, retries=False, **tls)
    proxy = None if security.ca_file else environ_proxy(base_url)  # as EtcdSecurity.session does
    return urllib3.ProxyManager(proxy, **options) if proxy else urllib3.PoolManager(**options)


class UnaryClient:
    """POSTs JSON to one member's ``/v3`` gateway over one kept connection; one thread at a time."""

    def __init__(self, base_url: str, security: EtcdSecurity,
                 on_body: Callable[[int], None] | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.headers: dict[str, str] = dict(_JSON)
        """Sent with every request; the store sets ``Authorization`` here."""
        self._on_body = on_body
        self._http = _pool_manager(self.base_url, security)

    def post(self, path: str, body: dict[str, Any], timeout: float) -> Any:
        """``path`` under ``/v3`` (``/kv/range``); the decoded JSON answer."""
        data = self._send(f"{self.base_url}/v3{path}", json.dumps(body).encode(), timeout)
        return json.loads(data)

    def _send(self, url: str, payload: bytes, timeout: float) -> bytes:
        try:
            resp = self._http.request("POST", url, body=payload, headers=self.headers,
                                      timeout=urllib3.Timeout(connect=timeout, read=timeout))
        except urllib3.exceptions.NewConnectionError as exc:  # a subclass of the timeout error, first
            raise gw_exc.ConnectionFailedError(str(exc)) from exc
        except urllib3.exceptions.TimeoutError as exc:
            raise gw_exc.ConnectionTimeoutError(str(exc)) from exc
        except (urllib3.exceptions.HTTPError, http.client.HTTPException, OSError) as exc:
            raise gw_exc.ConnectionFailedError(str(exc)) from exc
        if self._on_body is not None:
            self._on_body(len(resp.data))
        if resp.status != 200:
            text = resp.data.decode(errors="replace")
            raise _BY_STATUS.get(resp.status, gw_exc.Etcd3Exception)(text, resp.reason)
        return resp.data

    def stream(self, path: str, payload: bytes, connect_timeout: float, read_timeout: float) -> urllib3.BaseHTTPResponse:
        """A streaming POST (a watch): the response with its body unread; urllib3's errors raised
        as they are (the watch reconnects on any of them).  Close it, then ``release_conn()``."""
        return self._http.request("POST", f"{self.base_url}/v3{path}", body=payload, headers=self.headers,
                                  timeout=urllib3.Timeout(connect=connect_timeout, read=read_timeout),
                                  preload_content=False, release_conn=False)

    def close(self) -> None:
        self._http.clear()
