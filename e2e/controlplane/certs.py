"""Certificates, keys and kubeconfigs for the e2e control plane, made with the openssl CLI."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

# Names and addresses the apiserver certificate must be valid for: loopback for host
# clients, the pod-network gateway and the `kubernetes` Service IP for in-pod clients.
APISERVER_DNS = (
    "localhost",
    "kubernetes",
    "kubernetes.default",
    "kubernetes.default.svc",
    "kubernetes.default.svc.cluster.local",
)


@dataclass(frozen=True)
class Pki:
    """Paths of the generated credentials in the state directory."""

    dir: Path

    @property
    def ca_crt(self) -> Path:
        return self.dir / "ca.crt"

    @property
    def ca_key(self) -> Path:
        return self.dir / "ca.key"

    @property
    def sa_key(self) -> Path:
        return self.dir / "sa.key"

    @property
    def sa_pub(self) -> Path:
        return self.dir / "sa.pub"

    def crt(self, name: str) -> Path:
        return self.dir / f"{name}.crt"

    def key(self, name: str) -> Path:
        return self.dir / f"{name}.key"


def _openssl(*args: str, cwd: Path) -> None:
    if shutil.which("openssl") is None:
        raise RuntimeError("the openssl CLI is needed to create the e2e certificates")
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _private_key(path: Path) -> None:
    """A P-256 key: Kubernetes takes ECDSA everywhere, and it is made far faster than RSA."""
    _openssl(
        "genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", str(path),
        cwd=path.parent,
    )  # fmt: skip
    path.chmod(0o600)


def create_ca(pki: Pki) -> None:
    pki.dir.mkdir(parents=True, exist_ok=True)
    _private_key(pki.ca_key)
    _openssl(
        "req", "-x509", "-new", "-key", str(pki.ca_key), "-days", "3650",
        "-subj", "/CN=llmpool-e2e-ca", "-out", str(pki.ca_crt), cwd=pki.dir,
    )  # fmt: skip


def create_service_account_keys(pki: Pki) -> None:
    _private_key(pki.sa_key)
    _openssl("pkey", "-in", str(pki.sa_key), "-pubout", "-out", str(pki.sa_pub), cwd=pki.dir)


def issue(
    pki: Pki,
    name: str,
    common_name: str,
    organization: str | None = None,
    *,
    dns: tuple[str, ...] = (),
    ips: tuple[str, ...] = (),
    server: bool = False,
) -> None:
    """Issue ``<name>.crt``/``<name>.key`` signed by the CA (client or serving certificate)."""
    subject = f"/CN={common_name}" + (f"/O={organization}" if organization else "")
    usage = "serverAuth" if server else "clientAuth"
    sans = [f"DNS:{d}" for d in dns] + [f"IP:{ip}" for ip in ips]
    ext = [
        "basicConstraints=CA:FALSE",
        "keyUsage=critical,digitalSignature,keyEncipherment",
        f"extendedKeyUsage={usage}",
    ]
    if sans:
        ext.append("subjectAltName=" + ",".join(sans))
    ext_file = pki.dir / f"{name}.ext"
    ext_file.write_text("\n".join(ext) + "\n")
    csr = pki.dir / f"{name}.csr"
    _private_key(pki.key(name))
    _openssl(
        "req", "-new", "-key", str(pki.key(name)), "-subj", subject, "-out", str(csr), cwd=pki.dir
    )
    _openssl(
        "x509", "-req", "-in", str(csr), "-CA", str(pki.ca_crt), "-CAkey", str(pki.ca_key),
        "-CAcreateserial", "-days", "3650", "-extfile", str(ext_file), "-out", str(pki.crt(name)),
        cwd=pki.dir,
    )  # fmt: skip
    csr.unlink()
    ext_file.unlink()


def write_kubeconfig(path: Path, server: str, pki: Pki, user: str, cert_name: str) -> None:
    """A kubeconfig that authenticates with the client certificate ``cert_name``."""
    path.write_text(
        f"""apiVersion: v1
kind: Config
clusters:
- name: llmpool-e2e
  cluster:
    server: {server}
    certificate-authority: {pki.ca_crt}
users:
- name: {user}
  user:
    client-certificate: {pki.crt(cert_name)}
    client-key: {pki.key(cert_name)}
contexts:
- name: llmpool-e2e
  context:
    cluster: llmpool-e2e
    user: {user}
    namespace: default
current-context: llmpool-e2e
"""
    )
    path.chmod(0o600)
