"""A C kernel as it was at another git revision, built for this CPU as the current one is, so
that a benchmark times a change to a kernel against what it replaced in one process."""

from __future__ import annotations

import ctypes
import subprocess
import tempfile
from pathlib import Path

from llmpool.engine.kernels import c_loader


def kernel_at_revision(kernel: c_loader.CKernel, revision: str) -> ctypes.CDLL:
    """``kernel``'s source as it was at git ``revision``, with the headers it included then,
    built with this CPU's flags for the current build."""
    folder = kernel.source.parent

    def show(name: str) -> bytes:
        return subprocess.run(
            ["git", "-C", str(folder), "show", f"{revision}:./{name}"],
            capture_output=True,
            check=True,
        ).stdout

    copy = Path(tempfile.mkdtemp(prefix=f"{kernel.source.stem}-{revision}-"))
    source = copy / kernel.source.name
    source.write_bytes(show(source.name))
    for header in c_loader.included_headers(source.read_bytes()):
        (copy / header).write_bytes(show(header))
    library = c_loader.build(source, kernel.arch() or [], kernel.signatures)
    if library is None:
        raise SystemExit(f"{kernel.source.name} at {revision} does not build here (see the log)")
    return library
