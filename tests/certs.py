"""Throwaway certificates for mutual-TLS tests, made with the openssl CLI (Debian's
openssl package): a CA, a server certificate for 127.0.0.1/localhost, and client
certificates signed by that CA or by a stranger's CA."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Pair:
    cert: str
    key: str


@dataclass(frozen=True)
class Pki:
    ca: str  # the CA both sides trust
    server: Pair
    client: Pair  # signed by `ca`
    stranger: Pair  # signed by another CA


def _run(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


def _ca(d: Path, name: str) -> Pair:
    key, cert = d / f"{name}.key", d / f"{name}.crt"
    _run("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "2",
         "-subj", f"/CN={name}")  # fmt: skip
    return Pair(str(cert), str(key))


def _leaf(d: Path, name: str, ca: Pair, ext: str) -> Pair:
    key, csr, cert = d / f"{name}.key", d / f"{name}.csr", d / f"{name}.crt"
    extfile = d / f"{name}.ext"
    extfile.write_text(ext)
    _run("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", str(key), "-out", str(csr), "-subj", f"/CN={name}")  # fmt: skip
    _run("x509", "-req", "-in", str(csr), "-CA", ca.cert, "-CAkey", ca.key,
         "-CAcreateserial", "-out", str(cert), "-days", "2", "-extfile", str(extfile))  # fmt: skip
    return Pair(str(cert), str(key))


def make_pki(d: Path) -> Pki:
    ca = _ca(d, "ca")
    other = _ca(d, "other-ca")
    server = _leaf(d, "server", ca, "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                   "extendedKeyUsage=serverAuth\n")  # fmt: skip
    client = _leaf(d, "kube-scheduler", ca, "extendedKeyUsage=clientAuth\n")
    stranger = _leaf(d, "stranger", other, "extendedKeyUsage=clientAuth\n")
    return Pki(ca.cert, server, client, stranger)
