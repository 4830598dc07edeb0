"""Secured etcd (TLS client certs, user/password auth), run token, join fingerprint, no leaked secrets.

Every test talks to a real etcd started with ``--client-cert-auth`` and, where
auth matters, with etcd's auth enabled through its gateway API; the PKI is
generated per module (tests/etcd_certs.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from elastic.control.admission import EXIT_FINGERPRINT, EXIT_WRONG_TOKEN, Admission, Refused, join_fingerprint
from elastic.common.config import ConfigError, from_dict, to_dict
from elastic.control.etcd_security import PASSWORD_ENV, EtcdClientConfig, EtcdSecurity
from elastic.control.etcd_server import EmbeddedEtcd, ServerTLS
from elastic.common.events import EventLog
from elastic.control.keys import RunKeys, run_prefix
from elastic.common.procs import descendants
from elastic.control.store import EtcdStore, StoreAuthError, StoreTLSError
from elastic.run.schema import RunConfig
from tests.etcd_certs import make_pki

PASSWORD = "pw-Zq81-not-in-any-file"
ROOT_PASSWORD = "root-pw-7c1e"
TOKEN = "run-token-4f0b9d2e-secret"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def secure_etcd(pki, tmp_path_factory):
    """TLS with required client certs, auth enabled, and a 1 s auth-token TTL (so tokens do expire)."""
    root = tmp_path_factory.mktemp("secure-etcd")
    server = EmbeddedEtcd(data_dir=root / "data", log_path=root / "etcd.log", auth_token_ttl_s=1,
                          tls=ServerTLS(str(pki.server_cert), str(pki.server_key), str(pki.ca)))
    server.start()
    server.enable_auth("elastic", PASSWORD, ROOT_PASSWORD)
    try:
        yield server
    finally:
        server.close()


def _security(pki, **overrides) -> EtcdSecurity:
    base = EtcdSecurity(ca_file=str(pki.ca), cert_file=str(pki.client_cert), key_file=str(pki.client_key),
                        username="elastic", password=PASSWORD)
    return dataclasses.replace(base, **overrides)


def _store(server, security) -> EtcdStore:
    return EtcdStore(server.endpoint, request_timeout=2.0, retry_deadline=2.0, security=security)


# -- TLS ------------------------------------------------------------------------------------------

def test_tls_with_client_cert_works_and_token_is_renewed(secure_etcd, pki):
    store = _store(secure_etcd, _security(pki))
    store.put("/sec/a", "1")
    assert store.get("/sec/a").value == b"1"
    lease = store.grant_lease(5)
    assert store.refresh_lease(lease) > 0
    rev = store.revision()
    store.put("/sec/a", "2")
    event = store.watch_once("/sec/a", rev + 1, timeout=2.0)
    assert event is not None and event.value == b"2"
    first_token = store._token
    time.sleep(2.2)  # past --auth-token-ttl: etcd answers "invalid auth token" and the store re-authenticates
    assert store.get("/sec/a").value == b"2"
    assert store._token is not None and store._token != first_token


@pytest.mark.parametrize("which", ["no client cert", "cert of another CA", "no CA"])
def test_tls_without_an_accepted_client_cert_fails_at_once_with_a_clear_error(secure_etcd, pki, which):
    security = {
        "no client cert": _security(pki, cert_file="", key_file=""),
        "cert of another CA": _security(pki, cert_file=str(pki.other_client_cert), key_file=str(pki.other_client_key)),
        "no CA": _security(pki, ca_file=""),
    }[which]
    started = time.monotonic()
    with pytest.raises(StoreTLSError) as err:
        _store(secure_etcd, security).get("/sec/a")
    message = str(err.value)
    assert "TLS handshake with etcd at 127.0.0.1:" in message and "\n" not in message
    assert ("certificate" in message) and "etcd.cert_file" in message
    assert time.monotonic() - started < 1.5, "a refused handshake must not be retried like an outage"


def test_plain_http_against_a_tls_etcd_says_so(secure_etcd):
    from elastic.control.store import StoreUnavailable

    with pytest.raises(StoreUnavailable, match="set etcd.ca_file"):
        EtcdStore(secure_etcd.endpoint, request_timeout=1.0, retry_deadline=0.5, security=EtcdSecurity()).get("/x")


# -- auth -----------------------------------------------------------------------------------------

def test_wrong_password_is_refused_with_one_line_that_hides_the_password(secure_etcd, pki):
    with pytest.raises(StoreAuthError) as err:
        _store(secure_etcd, _security(pki, password="not-the-password")).put("/sec/b", "x")
    message = str(err.value)
    assert message.startswith(f"etcd at {secure_etcd.endpoint} refused user 'elastic'")
    assert "invalid user ID or password" in message and "\n" not in message
    assert "not-the-password" not in message and PASSWORD not in message


def test_no_user_against_an_auth_etcd_names_the_settings(secure_etcd, pki):
    with pytest.raises(StoreAuthError, match="requires authentication .*etcd.username"):
        _store(secure_etcd, _security(pki, username="", password="")).get("/sec/b")


def test_rendezvous_backend_over_tls_and_auth(secure_etcd, pki, monkeypatch):
    """The torchrun handler takes TLS paths from --rdzv-conf and the password from the environment."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from elastic.rendezvous.backend import Etcd3RendezvousBackend, create_etcd3_handler

    security = _security(pki)
    monkeypatch.setenv("MY_ETCD_PW", PASSWORD)
    for name in ("ELASTIC_ETCD_CA_FILE", "ELASTIC_ETCD_CERT_FILE", "ELASTIC_ETCD_KEY_FILE", PASSWORD_ENV):
        monkeypatch.delenv(name, raising=False)
    conf = dict(item.split("=", 1) for item in dataclasses.replace(security, password="").rdzv_conf())
    conf["etcd_password_env"] = "MY_ETCD_PW"
    assert PASSWORD not in json.dumps(conf)
    params = RendezvousParameters(backend="etcd3", endpoint=secure_etcd.endpoint, run_id="sec-rdzv",
                                  min_nodes=1, max_nodes=1, **conf)
    handler = create_etcd3_handler(params)
    backend = handler._state_holder._backend  # the backend the handler built from the params
    assert isinstance(backend, Etcd3RendezvousBackend)
    assert backend.get_state() is None
    state, token, ok = backend.set_state(b"state-1")
    assert ok and state == b"state-1"
    assert backend.get_state() == (b"state-1", token)
    stale = backend.set_state(b"state-2", token=token - 1)
    assert stale is not None and stale[2] is False and stale[0] == b"state-1"


# -- config -----------------------------------------------------------------------------------------

def test_etcd_section_errors_name_the_field(pki, tmp_path):
    def err(data: dict) -> str:
        with pytest.raises(ConfigError) as exc:
            from_dict(RunConfig, data)
        return str(exc.value)

    assert err({"etcd": {"cert_file": str(pki.client_cert)}}).startswith("etcd.key_file: required together")
    assert err({"etcd": {"ca_file": str(tmp_path / "missing.pem")}}).startswith("etcd.ca_file: no such file")
    assert err({"etcd": {"username": "u"}}).startswith("etcd.username: needs password_env or password_file")
    assert err({"etcd": {"username": "u", "password_env": "A", "password_file": str(pki.ca)}}).startswith(
        "etcd.password_env: give password_env or password_file, not both")
    assert err({"etcd": {"username": "u", "password_env": "not a var"}}).startswith("etcd.password_env:")
    assert err({"etcd": {"password": "inline"}}).startswith("etcd.password: unknown key")
    assert err({"security": {"token_env": "T", "token_file": "x"}}).startswith("security.token_env")
    cfg = EtcdClientConfig(username="u", password_env="UNSET_PW_VAR_FOR_TEST")
    with pytest.raises(ConfigError, match="^etcd.password_env: environment variable UNSET_PW_VAR_FOR_TEST is not set"):
        cfg.resolve(environ={})
    (tmp_path / "pw").write_text(PASSWORD + "\n")
    resolved = EtcdClientConfig(username="u", password_file=str(tmp_path / "pw")).resolve(environ={})
    assert resolved.password == PASSWORD and PASSWORD not in repr(resolved)


# -- run token and join fingerprint -----------------------------------------------------------------

def _admission(node: str, token: str | None, cfg: dict | None = None, check: str = "refuse") -> Admission:
    return Admission(run_id="adm", node_id=node, token=token, join_check=check,
                     fingerprint=join_fingerprint(cfg if cfg is not None else to_dict(RunConfig())))


def test_run_token_admits_the_same_token_and_refuses_others(secure_etcd, pki, tmp_path):
    store = _store(secure_etcd, _security(pki))
    prefix = run_prefix("/elastic", f"adm-{time.monotonic_ns()}")
    events = EventLog(tmp_path / "ev.jsonl", "test")
    _admission("n0", TOKEN).check(store, RunKeys(prefix), events)
    _admission("n1", TOKEN).check(store, RunKeys(prefix), events)
    record = store.get(f"{prefix}/admission/token").value.decode()
    assert TOKEN not in record and json.loads(record)["hash"]
    for token, needle in (("another-runs-token", "does not match"), (None, "requires a run token")):
        with pytest.raises(Refused, match=needle) as err:
            _admission("intruder", token).check(store, RunKeys(prefix), events)
        assert err.value.code == EXIT_WRONG_TOKEN and TOKEN not in str(err.value)
    events.close()
    assert TOKEN not in (tmp_path / "ev.jsonl").read_text()


def test_join_fingerprint_refuses_other_config_or_code_and_says_which(secure_etcd, pki, tmp_path):
    store = _store(secure_etcd, _security(pki))
    prefix = run_prefix("/elastic", f"fp-{time.monotonic_ns()}")
    events = EventLog(None, "test")
    base = to_dict(RunConfig())
    _admission("n0", None, base).check(store, RunKeys(prefix), events)
    # Per-node fields may differ: the node id, its run dir, its etcd credentials.
    per_node = json.loads(json.dumps(base))
    per_node["launch"]["node_id"] = "n1"
    per_node["run"]["dir"] = "/elsewhere"
    per_node["etcd"]["username"] = "someone"
    _admission("n1", None, per_node).check(store, RunKeys(prefix), events)
    changed = json.loads(json.dumps(base))
    changed["trainer"]["lr"] = 0.5
    with pytest.raises(Refused, match=r"^this node's config differs from run adm's \(recorded by n0\)") as err:
        _admission("n2", None, changed).check(store, RunKeys(prefix), events)
    assert err.value.code == EXIT_FINGERPRINT
    other_code = Admission(run_id="adm", node_id="n3", fingerprint={**join_fingerprint(base), "code": "0" * 16})
    with pytest.raises(Refused, match="this node's code differs"):
        other_code.check(store, RunKeys(prefix), events)
    _admission("n4", None, changed, check="warn").check(store, RunKeys(prefix), events)  # warns, admits


@pytest.mark.slow
def test_agent_with_another_runs_token_exits_94(secure_etcd, pki, tmp_path, subprocess_env):
    """The real agent process: refused before it registers, one line on stderr, exit code 94."""
    store = _store(secure_etcd, _security(pki))
    _admission("n0", TOKEN).check(store, RunKeys.of("/elastic", "agent94"), EventLog(None, "test"))
    cfg = {"run": {"id": "agent94"}, "launch": {"etcd_endpoint": secure_etcd.endpoint},
           "etcd": {"ca_file": str(pki.ca), "cert_file": str(pki.client_cert), "key_file": str(pki.client_key),
                    "username": "elastic", "password_env": "TEST_ETCD_PW"},
           "security": {"token_env": "TEST_RUN_TOKEN"}, "agent": {"preflight": {"enabled": False}}}
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    env = {**subprocess_env, "TEST_ETCD_PW": PASSWORD, "TEST_RUN_TOKEN": "another-runs-token"}
    proc = subprocess.run([sys.executable, "-m", "elastic.agent", "--run-id", "agent94", "--node-id", "intruder",
                           "--etcd-endpoint", secure_etcd.endpoint, "--run-dir", str(tmp_path / "run"),
                           "--config", str(tmp_path / "cfg.yaml")], env=env, capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == EXIT_WRONG_TOKEN, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines == [("elastic-agent: node intruder refused: this node's run token does not match the one "
                      "recorded for run agent94 by n0 (a node of another run?)")], proc.stderr


# -- a real launch: secrets appear nowhere ------------------------------------------------------------

class _ArgvWatcher(threading.Thread):
    """Collects the command lines of every process below ``pid`` while the launch runs (what ps shows)."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.cmdlines: dict[int, str] = {}
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.wait(0.1):
            for child in [self.pid, *descendants(self.pid)]:
                try:
                    raw = Path(f"/proc/{child}/cmdline").read_bytes()
                except OSError:
                    continue
                if raw:
                    self.cmdlines[child] = raw.replace(b"\0", b" ").decode(errors="replace")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_secured_cluster_launch_leaks_no_secret(secure_etcd, pki, tmp_path, subprocess_env):
    """elastic-launch against the TLS + auth etcd with a run token: trains to the end, one real
    torchrun rendezvous and checkpoint publishing over TLS + auth, the preflight etcd check passes,
    and neither the password nor the token is in any file of the run dir, the output or any argv."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    run_dir = tmp_path / "run"
    cfg = {"run": {"id": "secure", "dir": str(run_dir)}, "launch": {"nodes": "1", "nproc_per_node": 1},
           "agent": {"max_restarts": 0, "term_grace_s": 2, "preflight": {"checks": ["etcd"]}},
           "checkpoint": {"interval_steps": 3, "keep_last": 1},
           "trainer": {"steps": 6, "batch_size": 4, "dim": 8, "depth": 1, "lr": 0.01, "step_sleep": 0.0}}
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(cfg))
    env = {**subprocess_env, "SECRET_ETCD_PW": PASSWORD}
    cmd = [sys.executable, "-m", "launch", str(config), "--etcd-endpoint", secure_etcd.endpoint, "--node-id", "n0",
           "--etcd-ca", str(pki.ca), "--etcd-cert", str(pki.client_cert), "--etcd-key", str(pki.client_key),
           "--etcd-user", "elastic", "--etcd-password-env", "SECRET_ETCD_PW", "--run-token-file", str(token_file)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    watcher = _ArgvWatcher(proc.pid)
    watcher.start()
    out, _ = proc.communicate(timeout=110)
    watcher.halt.set()
    watcher.join()
    assert proc.returncode == 0, out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["last_step"] == 6 and summary["checkpoints_committed"] == [3, 6]
    events = [json.loads(line) for path in (run_dir / "events").glob("*.jsonl") for line in path.read_text().splitlines()]
    kinds = {e["kind"] for e in events}
    assert {"agent.run_token_recorded", "agent.fingerprint_recorded", "agent.screen"} <= kinds
    assert all(e["passed"] for e in events if e["kind"] == "agent.screen")
    assert any("torch.distributed.run" in c for c in watcher.cmdlines.values()), \
        f"the argv watcher saw no torchrun: {sorted(watcher.cmdlines.values())}"
    assert any("etcd_ca_file=" in c for c in watcher.cmdlines.values()), "TLS paths go in --rdzv-conf"
    files = [p for p in run_dir.rglob("*") if p.is_file()]
    assert len(files) > 10
    for secret in (PASSWORD, TOKEN):
        assert secret not in out
        for path in files:
            assert secret.encode() not in path.read_bytes(), f"{secret!r} leaked into {path}"
        for pid, cmdline in watcher.cmdlines.items():
            assert secret not in cmdline, f"{secret!r} on the command line of pid {pid}: {cmdline}"
    # The run's records in etcd hold a salted hash, never the token.
    store = _store(secure_etcd, _security(pki))
    assert TOKEN not in json.dumps([kv.value.decode(errors="replace") for kv in store.get_prefix("/elastic/runs/secure/")])


def test_launcher_refuses_a_wrong_password_before_starting_agents(secure_etcd, pki, monkeypatch, capsys):
    from launch.cli import main

    monkeypatch.setenv("WRONG_PW_FOR_TEST", "not-the-password")
    for name in ("ELASTIC_ETCD_CA_FILE", "ELASTIC_ETCD_CERT_FILE", "ELASTIC_ETCD_KEY_FILE", "ELASTIC_ETCD_USER",
                 PASSWORD_ENV):
        # prepare_etcd_access exports them: setenv first so that monkeypatch removes them again afterwards.
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    rc = main(["--etcd-endpoint", secure_etcd.endpoint, "--etcd-ca", str(pki.ca), "--etcd-cert", str(pki.client_cert),
               "--etcd-key", str(pki.client_key), "--etcd-user", "elastic", "--etcd-password-env", "WRONG_PW_FOR_TEST"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.splitlines() == [(f"elastic-launch: etcd error: etcd at {secure_etcd.endpoint} refused user 'elastic': "
                                 "etcdserver: authentication failed, invalid user ID or password")]
    assert "not-the-password" not in err


def test_no_etcd_setting_leaked_into_this_process():
    """Guard for the in-process tests above: a leftover ELASTIC_ETCD_* would turn every later store into https."""
    assert not {k for k in os.environ if k.startswith("ELASTIC_ETCD_")}


def test_plain_session_reads_the_environment_once(monkeypatch):
    # requests re-reads proxies and CA bundles from the environment on every request unless
    # trust_env is off; the session resolves them once, for its own endpoint, instead.
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    monkeypatch.setenv("NO_PROXY", "127.0.0.2")
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", "/etc/ssl/certs/run-ca.pem")
    proxied = EtcdSecurity().session("http://127.0.0.3:2379")
    direct = EtcdSecurity().session("http://127.0.0.2:2379")
    assert not proxied.trust_env and not direct.trust_env
    assert proxied.proxies.get("http") == "http://127.0.0.1:9"
    assert "http" not in direct.proxies
    assert proxied.verify == "/etc/ssl/certs/run-ca.pem"


def test_session_with_a_ca_file_ignores_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", "/etc/ssl/certs/other.pem")
    session = EtcdSecurity(ca_file=str(tmp_path / "ca.pem")).session("https://127.0.0.3:2379")
    assert session.verify == str(tmp_path / "ca.pem") and not session.proxies
