"""A throwaway test PKI made with the `openssl` CLI (no extra dependency): CAs, leaf
certificates with chosen extended key usages and subject names, and expired ones. Shared by
the API's TLS tests and the KV channel's mTLS tests; never used outside tests."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
CA_CONFIG = """[ca]
default_ca = test
[test]
database = index.txt
new_certs_dir = .
serial = serial.txt
default_md = sha256
policy = any
[any]
commonName = supplied
"""


def openssl(folder: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True, timeout=60)


def make_ca(folder: Path, name: str) -> None:
    openssl(folder, "req", "-x509", *EC, "-keyout", f"{name}.key", "-out", f"{name}.pem",
            "-days", "2", "-subj", f"/CN=kvrelay {name}",
            "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign")  # fmt: skip


def _request(folder: Path, name: str, usage: str, san: str = "") -> None:
    """A key, a signing request and the extensions of leaf certificate `name`."""
    openssl(folder, "req", *EC, "-keyout", f"{name}.key", "-out", f"{name}.csr",
            "-subj", f"/CN={name}")  # fmt: skip
    lines = ["basicConstraints=CA:FALSE", "keyUsage=critical,digitalSignature",
             f"extendedKeyUsage={usage}", "subjectKeyIdentifier=hash",
            "authorityKeyIdentifier=keyid"]  # fmt: skip
    if san:
        lines.append(f"subjectAltName={san}")
    (folder / f"{name}.ext").write_text("\n".join(lines) + "\n")


def make_leaf(folder: Path, name: str, ca: str, usage: str, san: str = "") -> None:
    _request(folder, name, usage, san)
    openssl(folder, "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem",
            "-CAkey", f"{ca}.key", "-CAcreateserial", "-days", "2",
            "-extfile", f"{name}.ext", "-out", f"{name}.pem")  # fmt: skip


def make_expired(folder: Path, name: str, ca: str) -> None:
    """Signed by the right CA, valid for one day in 2020 (`openssl ca` can date it back)."""
    _request(folder, name, "clientAuth")
    (folder / "ca.cnf").write_text(CA_CONFIG)
    (folder / "index.txt").write_text("")
    (folder / "serial.txt").write_text("1000\n")
    openssl(folder, "ca", "-batch", "-config", "ca.cnf", "-cert", f"{ca}.pem",
            "-keyfile", f"{ca}.key", "-in", f"{name}.csr", "-out", f"{name}.pem",
            "-extfile", f"{name}.ext", "-notext",
            "-startdate", "20200101000000Z", "-enddate", "20200102000000Z")  # fmt: skip


def have_openssl() -> bool:
    return shutil.which("openssl") is not None
