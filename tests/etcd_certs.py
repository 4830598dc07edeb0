"""Throw-away PKI for the TLS tests: a CA, a server cert for 127.0.0.1 and a client cert.

Made with the ``openssl`` CLI when it is installed, else with the ``cryptography``
package (a test dependency).  The client certificate has no CommonName on purpose:
etcd 3.5 refuses gateway requests from a client cert with a CN once auth is
enabled (it would be taken for CN-based auth, which the gateway cannot do).
"""

from __future__ import annotations

import datetime
import ipaddress
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ThrowawayPKI:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_client_cert: Path  # signed by an unrelated CA: the server must refuse it
    other_client_key: Path


def make_pki(root: Path) -> ThrowawayPKI:
    root.mkdir(parents=True, exist_ok=True)
    if shutil.which("openssl"):
        _with_openssl(root)
    else:
        _with_cryptography(root)
    return ThrowawayPKI(ca=root / "ca.pem", server_cert=root / "server.pem", server_key=root / "server.key",
                   client_cert=root / "client.pem", client_key=root / "client.key",
                   other_client_cert=root / "other.pem", other_client_key=root / "other.key")


def _openssl(root: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=root, check=True, capture_output=True, timeout=30)


def _with_openssl(root: Path) -> None:
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    (root / "server.ext").write_text("subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n")
    (root / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    for ca in ("ca", "otherca"):
        _openssl(root, "req", "-x509", *ec, "-keyout", f"{ca}.key", "-out", f"{ca}.pem", "-days", "2",
                 "-subj", f"/CN={ca}")
    for name, ca, subj, ext in (("server", "ca", "/CN=127.0.0.1", "server.ext"),
                                ("client", "ca", "/O=elastic-test", "client.ext"),
                                ("other", "otherca", "/O=elastic-test", "client.ext")):
        _openssl(root, "req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", subj)
        _openssl(root, "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
                 "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile", ext)


def _with_cryptography(root: Path) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def key_pem(key) -> bytes:
        return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())

    def build(subject, issuer, pub, signer, *extensions):
        builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(pub)
                   .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=2)))
        for ext, critical in extensions:
            builder = builder.add_extension(ext, critical=critical)
        return builder.sign(signer, hashes.SHA256())

    cas = {}
    for ca in ("ca", "otherca"):
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, ca)])
        cert = build(name, name, key.public_key(), key, (x509.BasicConstraints(ca=True, path_length=None), True))
        (root / f"{ca}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        cas[ca] = (key, name)
    usages = {"server": [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH],
              "client": [ExtendedKeyUsageOID.CLIENT_AUTH], "other": [ExtendedKeyUsageOID.CLIENT_AUTH]}
    for name, ca in (("server", "ca"), ("client", "ca"), ("other", "otherca")):
        key = ec.generate_private_key(ec.SECP256R1())
        attr = (NameOID.COMMON_NAME, "127.0.0.1") if name == "server" else (NameOID.ORGANIZATION_NAME, "elastic-test")
        extensions = [(x509.ExtendedKeyUsage(usages[name]), False)]
        if name == "server":
            extensions.append((x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False))
        ca_key, ca_name = cas[ca]
        cert = build(x509.Name([x509.NameAttribute(*attr)]), ca_name, key.public_key(), ca_key, *extensions)
        (root / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (root / f"{name}.key").write_bytes(key_pem(key))
