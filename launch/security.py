"""``elastic-launch`` flags for the secured etcd and the run token, and the checks before a launch.

The flags set fields of the ``etcd:`` and ``security:`` sections; they are
applied together (a client cert and its key given as two flags are validated
as a pair).  No flag takes a secret: passwords and tokens are named by
environment variable or file, since a command line is visible in ``ps``.
"""

from __future__ import annotations

import argparse
import os

from elastic.common.config import ConfigError, from_dict, to_dict
from elastic.control.etcd_security import CA_ENV, CERT_ENV, KEY_ENV, PASSWORD_ENV, USER_ENV
from elastic.run.schema import RunConfig

# flag -> dotted config field
SECURITY_FLAGS = {
    "--etcd-ca": "etcd.ca_file",
    "--etcd-cert": "etcd.cert_file",
    "--etcd-key": "etcd.key_file",
    "--etcd-user": "etcd.username",
    "--etcd-password-env": "etcd.password_env",
    "--etcd-password-file": "etcd.password_file",
    "--run-token-env": "security.token_env",
    "--run-token-file": "security.token_file",
}
_METAVARS = {"--etcd-user": "NAME", "--etcd-password-env": "VAR", "--run-token-env": "VAR"}


def add_security_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("secured etcd and run token (cluster mode)")
    for flag, dotted in SECURITY_FLAGS.items():
        group.add_argument(flag, metavar=_METAVARS.get(flag, "FILE"), help=f"({dotted})")


def apply_security_flags(cfg: RunConfig, args: argparse.Namespace) -> RunConfig:
    """Return ``cfg`` with the given security flags set; ConfigError names the flag of a bad value."""
    data = to_dict(cfg)
    given: dict[str, str] = {}
    for flag, dotted in SECURITY_FLAGS.items():
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value is not None:
            section, key = dotted.split(".")
            data[section][key] = value
            given[dotted] = flag
    if not given:
        return cfg
    try:
        return from_dict(type(cfg), data)
    except ConfigError as exc:
        flag = given.get(exc.path)
        raise ConfigError(flag, exc.message) if flag else exc from None


def prepare_etcd_access(cfg: RunConfig) -> None:
    """Put the etcd credentials where the launcher's children find them (the environment), or refuse.

    Local mode runs its own plain etcd on 127.0.0.1, so TLS / auth settings there are an
    error, and stray ``ELASTIC_ETCD_*`` variables from the shell are dropped.  In cluster
    mode the password is read now (ConfigError naming the field if it cannot be) and one
    request checks that etcd accepts the credentials (StoreAuthError / StoreTLSError).
    """
    if not cfg.launch.etcd_endpoint:
        if cfg.etcd.enabled:
            raise ConfigError("etcd", "TLS / auth settings need launch.etcd_endpoint "
                                      "(local mode runs its own plain etcd on 127.0.0.1)")
        for name in (CA_ENV, CERT_ENV, KEY_ENV, USER_ENV, PASSWORD_ENV):
            os.environ.pop(name, None)
        return
    cfg.security.token()  # unreadable token: one line now, not N agents failing later
    if not cfg.etcd.enabled:
        return
    security = cfg.etcd.resolve()
    os.environ.update(security.env())
    from elastic.control.store import EtcdStore, StoreUnavailable

    try:
        EtcdStore(cfg.launch.etcd_endpoint, request_timeout=3.0, retry_deadline=3.0, security=security).revision()
    except StoreUnavailable:
        pass  # an outage is the agents' to wait out; only refused credentials stop the launch here
