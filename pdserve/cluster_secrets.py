"""What `pdserve up` makes so its processes trust each other: a random token, and with --tls a
CA and one certificate (for this host's loopback names) signed by it. Made with the openssl
command line, in a private folder removed when `up` stops."""
from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path


@dataclass
class ClusterSecrets:
    folder: Path
    token_file: str
    cert_file: str = ""
    key_file: str = ""
    ca_file: str = ""

    def server_flags(self) -> list[str]:
        """What every child is started with."""
        flags = ["--internal-token-file", self.token_file]
        if self.ca_file:
            flags += ["--tls-cert-file", self.cert_file, "--tls-key-file", self.key_file,
                      "--tls-ca-file", self.ca_file]
        return flags

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def make_secrets(token_file: str, tls: bool, host: str) -> ClusterSecrets:
    folder = Path(tempfile.mkdtemp(prefix="pdserve-"))   # mode 0700
    if not token_file:
        token_file = str(folder / "token")
        fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32))
    made = ClusterSecrets(folder, token_file)
    if tls:
        if shutil.which("openssl") is None:
            raise RuntimeError("--tls needs the openssl command (apt-get install openssl)")
        _certificates(folder, host)
        made.cert_file, made.key_file, made.ca_file = (str(folder / n) for n in
                                                       ("node.crt", "node.key", "ca.crt"))
    return made


def _certificates(folder: Path, host: str) -> None:
    names = f"DNS:localhost,IP:127.0.0.1,{'IP' if host[0].isdigit() else 'DNS'}:{host}"

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "30", "-subj",
            "/CN=pdserve cluster CA", "-keyout", "ca.key", "-out", "ca.crt")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=pdserve", "-keyout",
            "node.key", "-out", "node.csr")
    (folder / "ext.cnf").write_text(f"subjectAltName={names}\n")
    openssl("x509", "-req", "-in", "node.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-days", "30", "-extfile", "ext.cnf", "-out", "node.crt")
