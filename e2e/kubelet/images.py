"""Which program a container's image stands for, on a kubelet that runs no images.

A container runs ``command`` + ``args`` from its spec, as Kubernetes defines: ``command``
replaces the image's ENTRYPOINT and ``args`` its CMD. This kubelet has no images, so the
ENTRYPOINT of the project's own image is mapped here, in this one table:

* any image whose name contains ``llmpool``: ENTRYPOINT is the project's console script
  ``llmpool`` (next to the kubelet's Python, else on PATH); CMD is empty.

Every other image has no ENTRYPOINT here: its containers must set ``command``, and the
command must be an executable on the host (e.g. ``python3 -m http.server``).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from .api import Json
from .envs import ConfigError, expand


def llmpool_entrypoint() -> str:
    beside_python = Path(sys.executable).parent / "llmpool"
    if beside_python.exists():
        return str(beside_python)
    found = shutil.which("llmpool")
    if found is None:
        raise ConfigError("image maps to the `llmpool` console script, which is not installed")
    return found


def entrypoint(image: str) -> list[str] | None:
    """The ENTRYPOINT this kubelet assigns to ``image``; None when it knows none."""
    if "llmpool" in image:
        return [llmpool_entrypoint()]
    return None


def container_argv(container: Json, env: dict[str, str]) -> list[str]:
    """command + args with $(VAR) expansion, the image ENTRYPOINT standing in for command."""
    command = container.get("command")
    if not command:
        command = entrypoint(container.get("image", ""))
        if command is None:
            raise ConfigError(
                f"image {container.get('image')!r} has no entrypoint on this kubelet; "
                "set the container's command (see e2e/README.md)"
            )
    return [expand(part, env) for part in command] + [
        expand(a, env) for a in container.get("args", [])
    ]
