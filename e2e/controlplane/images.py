"""Images for the node without a registry: single-binary images (pause, CoreDNS) written as
OCI archives from binaries built here, and any archive (``docker save``) imported into
containerd's ``k8s.io`` namespace, where the kubelet's pods find them (``IfNotPresent``).
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_LAYER = "application/vnd.oci.image.layer.v1.tar"
NOBODY = "65534:65534"


@dataclass(frozen=True)
class ScratchImage:
    """An image ``FROM scratch`` holding one static binary as its entrypoint."""

    name: str  # full reference, e.g. localhost/e2e/pause:3.10
    binary: Path
    entrypoint: str  # the binary's path inside the image
    user: str = NOBODY
    exposed: tuple[str, ...] = ()


def _descriptor(media_type: str, blob: bytes) -> dict[str, object]:
    return {
        "mediaType": media_type,
        "digest": f"sha256:{hashlib.sha256(blob).hexdigest()}",
        "size": len(blob),
    }


def _layer(image: ScratchImage) -> bytes:
    """An uncompressed layer with the binary (0755) and /tmp; fixed times, so the same binary
    always makes the same digest."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        parts = Path(image.entrypoint.lstrip("/")).parts
        for depth in range(1, len(parts)):
            folder = tarfile.TarInfo("/".join(parts[:depth]))
            folder.type, folder.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(folder)
        tmp = tarfile.TarInfo("tmp")
        tmp.type, tmp.mode = tarfile.DIRTYPE, 0o1777
        tar.addfile(tmp)
        data = image.binary.read_bytes()
        entry = tarfile.TarInfo("/".join(parts))
        entry.size, entry.mode = len(data), 0o755
        tar.addfile(entry, io.BytesIO(data))
    return buf.getvalue()


def write_oci_archive(image: ScratchImage, dest: Path) -> Path:
    """Write ``image`` as an OCI image-layout tar that ``ctr images import`` names by itself."""
    layer = _layer(image)
    config = json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "config": {
                "Entrypoint": [image.entrypoint],
                "User": image.user,
                "ExposedPorts": {port: {} for port in image.exposed},
            },
            "rootfs": {"type": "layers", "diff_ids": [_descriptor(OCI_LAYER, layer)["digest"]]},
        },
        sort_keys=True,
    ).encode()
    manifest = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": OCI_MANIFEST,
            "config": _descriptor(OCI_CONFIG, config),
            "layers": [_descriptor(OCI_LAYER, layer)],
        },
        sort_keys=True,
    ).encode()
    tag = image.name.rsplit(":", 1)[1]
    index = {
        "schemaVersion": 2,
        "manifests": [
            {
                **_descriptor(OCI_MANIFEST, manifest),
                "platform": {"architecture": "amd64", "os": "linux"},
                "annotations": {
                    "io.containerd.image.name": image.name,
                    "org.opencontainers.image.ref.name": tag,
                },
            }
        ],
    }
    files = {
        "oci-layout": json.dumps({"imageLayoutVersion": "1.0.0"}).encode(),
        "index.json": json.dumps(index).encode(),
    }
    for blob in (layer, config, manifest):
        files[f"blobs/sha256/{hashlib.sha256(blob).hexdigest()}"] = blob
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(dest, mode="w") as tar:
        for name, blob in files.items():
            entry = tarfile.TarInfo(name)
            entry.size = len(blob)
            tar.addfile(entry, io.BytesIO(blob))
    return dest


def docker_image_id(image: str) -> str:
    """Docker's id of ``image``: the digest of its config, the id the CRI gives it too."""
    docker = shutil.which("docker")
    if docker is None:
        raise RuntimeError(f"no docker client on PATH to find {image} in")
    proc = subprocess.run(
        [docker, "image", "inspect", "--format", "{{.Id}}", image],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(
            f"{image} is not in Docker ({proc.stderr.strip()}): build it with scripts/build-image.sh"
        )
    return proc.stdout.strip()
