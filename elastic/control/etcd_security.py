"""TLS client certificates and user/password auth for the etcd connection.

Two layers:

* :class:`EtcdClientConfig` -- the ``etcd:`` section of the run YAML.  File
  paths only, and the password only *by reference* (the name of an environment
  variable, or a file), so a config file, ``config.resolved.yaml`` or a command
  line never holds a secret.
* :class:`EtcdSecurity` -- the resolved settings one client uses, password
  included (in memory only; it is left out of ``repr``).

How the settings reach the processes below the launcher: through the
environment (``ELASTIC_ETCD_*``, see :meth:`EtcdSecurity.env`), which every
child inherits and which ``ps`` does not show.  :class:`elastic.control.store.EtcdStore`
reads it when it is not handed settings explicitly, so the agent, torchrun's
rendezvous handler, the workers' checkpoint publisher and ``diag`` all connect
the same way.  The torchrun handler also takes the paths as ``--rdzv-conf``
keys (:data:`RDZV_KEYS`), for plain ``torchrun`` use outside the launcher.

This module imports nothing from :mod:`elastic.control.store` (the store imports it).
"""

from __future__ import annotations

import functools
import json
import os
import re
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests
import requests.utils
import urllib3

from elastic.common.config import ConfigError

CA_ENV = "ELASTIC_ETCD_CA_FILE"
CERT_ENV = "ELASTIC_ETCD_CERT_FILE"
KEY_ENV = "ELASTIC_ETCD_KEY_FILE"
USER_ENV = "ELASTIC_ETCD_USER"
PASSWORD_ENV = "ELASTIC_ETCD_PASSWORD"

# --rdzv-conf key -> EtcdSecurity field.  The password has no key: only the *name* of the
# variable holding it (password_env), because torchrun's argv is visible to every user.
RDZV_KEYS = {"etcd_ca_file": "ca_file", "etcd_cert_file": "cert_file", "etcd_key_file": "key_file",
             "etcd_user": "username"}
RDZV_PASSWORD_ENV_KEY = "etcd_password_env"

_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True, kw_only=True)
class EtcdSecurity:
    """Resolved TLS / auth settings of one etcd client.  All empty: plain HTTP, no auth."""

    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    username: str = ""
    password: str = field(default="", repr=False)

    @property
    def tls(self) -> bool:
        return bool(self.ca_file or self.cert_file)

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    def session(self, base_url: str | None = None) -> requests.Session:
        """A requests session that verifies the server against ``ca_file`` and presents the client cert.

        ``trust_env`` is always off.  With a CA file, because requests lets
        ``$REQUESTS_CA_BUNDLE`` / ``$CURL_CA_BUNDLE`` override a session's ``verify``, which
        would silently replace the run's CA with the system bundle (and fail, or trust more than
        intended); proxies from the environment are ignored with it, which suits etcd traffic.
        Without one, the environment is read *once* here (proxies for ``base_url``, honouring
        ``no_proxy``, and the CA bundle variables): requests re-reads all of it on every request,
        ~0.4 ms of CPU per etcd call (a third of a call's cost, measured; agents poll every 0.25 s).
        """
        session = requests.Session()
        session.trust_env = False
        if self.ca_file:
            session.verify = self.ca_file
        else:
            session.verify = os.environ.get("REQUESTS_CA_BUNDLE") or os.environ.get("CURL_CA_BUNDLE") or True
            proxy = environ_proxy(base_url) if base_url else None
            if proxy:
                session.proxies.update({base_url.split("://", 1)[0]: proxy})
        if self.cert_file:
            session.cert = (self.cert_file, self.key_file)
        return session

    def env(self) -> dict[str, str]:
        """The variables that hand these settings to a child process (empty values are left out)."""
        values = {CA_ENV: self.ca_file, CERT_ENV: self.cert_file, KEY_ENV: self.key_file,
                  USER_ENV: self.username, PASSWORD_ENV: self.password}
        return {k: v for k, v in values.items() if v}

    def rdzv_conf(self) -> list[str]:
        """``--rdzv-conf`` items for torchrun: paths and user name, never the password."""
        items = [f"{key}={getattr(self, name)}" for key, name in RDZV_KEYS.items() if getattr(self, name)]
        if self.username:
            items.append(f"{RDZV_PASSWORD_ENV_KEY}={PASSWORD_ENV}")
        return items

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> EtcdSecurity:
        env = os.environ if environ is None else environ
        return cls(ca_file=env.get(CA_ENV, ""), cert_file=env.get(CERT_ENV, ""), key_file=env.get(KEY_ENV, ""),
                   username=env.get(USER_ENV, ""), password=env.get(PASSWORD_ENV, ""))

    @classmethod
    def from_rdzv_conf(cls, get: Any, environ: Mapping[str, str] | None = None) -> EtcdSecurity:
        """From torchrun's ``--rdzv-conf`` (``get(key, default)``), the environment filling the gaps."""
        env = os.environ if environ is None else environ
        base = cls.from_env(env)
        values = {name: str(get(key, "") or getattr(base, name)) for key, name in RDZV_KEYS.items()}
        password_env = str(get(RDZV_PASSWORD_ENV_KEY, "") or PASSWORD_ENV)
        return cls(**values, password=env.get(password_env, ""))


@dataclass(kw_only=True)
class EtcdClientConfig:
    """The ``etcd:`` section: how this run's processes authenticate to etcd (cluster mode)."""

    ca_file: str = ""
    """CA bundle (PEM) that signed the etcd server's certificate; setting it switches to https."""
    cert_file: str = ""
    """Client certificate (PEM) for servers run with --client-cert-auth; needs key_file."""
    key_file: str = ""
    """Private key (PEM) of cert_file."""
    username: str = ""
    """etcd user (servers with auth enabled); needs password_env or password_file."""
    password_env: str = ""
    """Name of the environment variable that holds the password (the password itself never goes in YAML)."""
    password_file: str = ""
    """File whose first line is the password (e.g. a mounted secret)."""

    def __post_init__(self) -> None:
        for name in ("ca_file", "cert_file", "key_file", "password_file"):
            path = getattr(self, name)
            if not path:
                continue
            if "," in path or "=" in path:
                raise ConfigError(name, f"must not contain ',' or '=' (passed in torchrun's --rdzv-conf): {path!r}")
            if not Path(path).is_file():
                raise ConfigError(name, f"no such file: {path}")
        if bool(self.cert_file) != bool(self.key_file):
            given, missing = ("cert_file", "key_file") if self.cert_file else ("key_file", "cert_file")
            raise ConfigError(missing, f"required together with {given} (a client certificate needs its key)")
        if self.password_env and self.password_file:
            raise ConfigError("password_env", "give password_env or password_file, not both")
        if self.password_env and not _ENV_NAME_RE.match(self.password_env):
            raise ConfigError("password_env", f"must be an environment variable name, got {self.password_env!r}")
        has_password = bool(self.password_env or self.password_file)
        if self.username and not has_password:
            raise ConfigError("username", "needs password_env or password_file")
        if has_password and not self.username:
            raise ConfigError("username", "required when a password is given")
        if self.username and ("," in self.username or "=" in self.username):
            raise ConfigError("username", "must not contain ',' or '='")

    @property
    def enabled(self) -> bool:
        return bool(self.ca_file or self.cert_file or self.username)

    def resolve(self, environ: Mapping[str, str] | None = None, path: str = "etcd") -> EtcdSecurity:
        """Read the password and make the paths absolute; ConfigError (naming the field) if it cannot."""
        env = os.environ if environ is None else environ
        password = ""
        if self.password_env:
            password = env.get(self.password_env, "")
            if not password:
                raise ConfigError(f"{path}.password_env",
                                  f"environment variable {self.password_env} is not set or empty")
        elif self.password_file:
            password = read_secret_file(self.password_file, f"{path}.password_file")
        return EtcdSecurity(ca_file=_abs(self.ca_file), cert_file=_abs(self.cert_file), key_file=_abs(self.key_file),
                            username=self.username, password=password)


def read_secret_file(path: str, field_path: str) -> str:
    """First line of a secret file, stripped; ConfigError naming ``field_path`` if unreadable or empty."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(field_path, f"cannot read {path}: {exc.strerror}") from None
    lines = text.splitlines()
    secret = lines[0].strip() if lines else ""
    if not secret:
        raise ConfigError(field_path, f"{path} is empty")
    return secret


def _abs(path: str) -> str:
    return str(Path(path).resolve()) if path else ""


def etcd_error_text(exc: BaseException) -> str:
    """etcd's own message from a gateway error (etcd3gw keeps the response body in ``detail_text``)."""
    detail = getattr(exc, "detail_text", None)
    if detail:
        try:
            body = json.loads(detail)
            return str(body.get("message") or body.get("error") or detail).strip()
        except (ValueError, AttributeError):
            return str(detail).strip().splitlines()[0] if str(detail).strip() else str(exc)
    return str(exc)


_PROXY_VARS = ("http_proxy", "https_proxy", "all_proxy", "no_proxy")


def environ_proxy(base_url: str) -> str | None:
    """The proxy the environment names for ``base_url`` (``no_proxy`` honoured), or None.

    Looked up through requests' own rules, once per distinct setting: the lookup walks the whole
    environment (1.2 of 5 CPU-s per participant process in the 2,048 rendezvous, when every new
    session did it)."""
    key = tuple(os.environ.get(name) for v in _PROXY_VARS for name in (v, v.upper()))
    return _proxy_for(base_url, key)


@functools.lru_cache(maxsize=64)
def _proxy_for(base_url: str, _env_key: tuple[str | None, ...]) -> str | None:
    proxies = requests.utils.get_environ_proxies(base_url)
    scheme = base_url.split("://", 1)[0]
    return proxies.get(scheme) or proxies.get("all")


def ssl_error_in(exc: BaseException) -> BaseException | None:
    """The TLS error behind ``exc`` (etcd3gw re-raises requests' errors as its own), or None."""
    seen: BaseException | None = exc
    for _ in range(6):
        if seen is None:
            return None
        if isinstance(seen, (requests.exceptions.SSLError, urllib3.exceptions.SSLError, ssl.SSLError)):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def short_ssl_reason(exc: BaseException) -> str:
    """The OpenSSL reason of a requests SSLError, e.g. ``sslv3 alert bad certificate``."""
    text = str(exc)
    match = re.search(r"\[SSL: [A-Z0-9_]+\] ([^(')\"]+)", text)
    return match.group(1).strip() if match else text.splitlines()[0][:200]
