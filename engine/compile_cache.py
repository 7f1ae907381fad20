"""The compiled decoder's artifacts on disk, so that the next start (and every replica of a pool
sharing the volume) does not compile them again.

What is stored is torch's "mega cache" (``torch.compiler.save_cache_artifacts``): inductor's
FX-graph and AOT-autograd entries, the generated kernels' source included. Loading it fills
inductor's local caches, so the compile that follows hits them instead of running inductor's
lowering and codegen; dynamo still traces the decoder at every size, which torch does not cache.

An entry is ``<root>/<key>/``, the key a digest of everything that changes the artifacts
(``key_fields``). It is written whole to a temporary directory and renamed into place, so
replicas compiling at once never see half an entry; an entry that cannot be read is logged and
compiled over, never a failed start.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from llmpool import __version__
from llmpool.engine.cpu_features import cpu_flags

logger = logging.getLogger(__name__)

ARTIFACTS_FILE = "artifacts.bin"
KEY_FILE = "key.json"  # the key's fields, for whoever lists the cache
# ``--compile-cache-dir`` values that turn the cache off.
DISABLED = ("", "none")

CacheState = Literal["hit", "miss", "off"]
# off: eager by configuration; compiling: eager until the compile ends; failed: eager for good.
CompileState = Literal["off", "compiling", "compiled", "failed"]


def default_root() -> Path:
    """``$XDG_CACHE_HOME/llmpool/compile``, else ``~/.cache/llmpool/compile``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "llmpool" / "compile"


def cache_root(setting: str | None) -> Path | None:
    """The cache's root for a ``compile_cache_dir`` setting: None is the default root, ``''``
    or ``none`` turn the cache off (None)."""
    if setting is None:
        return default_root()
    if setting.strip().lower() in DISABLED:
        return None
    return Path(setting)


@functools.cache
def compiler_identity() -> str:
    """The C++ compiler inductor builds its kernels with, as its ``--version`` names it."""
    from torch._inductor.cpp_builder import get_cpp_compiler

    compiler = get_cpp_compiler()
    try:
        result = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, timeout=30, check=False
        )
    except OSError:
        return compiler
    return f"{compiler}: {result.stdout.partition(chr(10))[0].strip()}"


def environment_fields() -> dict[str, str]:
    """What the artifacts depend on in this process's environment, beside the engine settings."""
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "llmpool": __version__,
        "machine": platform.machine(),
        "cpuFlags": hashlib.sha256(" ".join(sorted(cpu_flags())).encode()).hexdigest(),
        "compiler": compiler_identity(),
    }


def cache_key(fields: Mapping[str, str]) -> str:
    """A short digest of ``fields``; any change of any field is another key."""
    text = json.dumps(dict(fields), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


@dataclass
class CompileReport:
    """What the compile did and where it is, for the log and ``/fingerprint``; the compile's
    thread updates it while the engine serves (``engine/background_compile.py``)."""

    enabled: bool
    state: CompileState = "off"
    cache: CacheState = "off"
    key: str | None = None
    seconds: float = 0.0
    error: str | None = None

    def as_dict(self) -> dict[str, object]:
        return {
            "enabled": self.enabled,
            "state": self.state,
            "cache": self.cache,
            "key": self.key,
            "seconds": round(self.seconds, 1),
            "error": self.error,
        }


class CompileCache:
    """One entry of the cache: ``load`` before compiling, ``save`` after a compile that missed."""

    def __init__(self, root: Path, fields: Mapping[str, str]) -> None:
        self.root = root
        self.fields = dict(fields)
        self.key = cache_key(fields)
        self.entry = root / self.key

    def load(self) -> bool:
        """Fill inductor's caches from the entry; False where there is none or it is unreadable."""
        path = self.entry / ARTIFACTS_FILE
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return False
        except OSError as error:
            logger.warning("ignoring the compile cache entry %s: %s", path, error)
            return False
        try:
            info = torch.compiler.load_cache_artifacts(data)
        except Exception as error:  # noqa: BLE001 - any unreadable entry means: compile cold
            logger.warning("ignoring the compile cache entry %s: %r", path, error)
            return False
        if info is None:
            logger.warning("ignoring the compile cache entry %s: torch could not read it", path)
            return False
        return True

    def save(self, artifacts: bytes) -> None:
        """Write the entry whole, or leave it to the replica that renamed its own first.

        An entry already in place is one this start could not read (else it would not have
        compiled), so it is replaced.
        """
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=f".{self.key}.", dir=self.root))
        except OSError as error:
            logger.warning("cannot write the compile cache under %s: %s", self.root, error)
            return
        try:
            (staging / ARTIFACTS_FILE).write_bytes(artifacts)
            (staging / KEY_FILE).write_text(json.dumps(self.fields, indent=1, sort_keys=True))
            if self.entry.exists():
                shutil.rmtree(self.entry, ignore_errors=True)
            staging.rename(self.entry)
        except OSError as error:
            logger.warning("compile cache entry %s not written: %s", self.entry, error)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
