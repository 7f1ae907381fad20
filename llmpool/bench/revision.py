"""A C kernel or a Python module as it was at another git revision (a kernel built for this CPU
as the current one is), so that a benchmark times a change against what it replaced in one
process."""

from __future__ import annotations

import ctypes
import subprocess
import sys
import tempfile
import types
from pathlib import Path

from llmpool.engine.kernels import c_loader


def kernel_at_revision(kernel: c_loader.CKernel, revision: str) -> ctypes.CDLL:
    """``kernel``'s source as it was at git ``revision``, with the headers it included then,
    built with this CPU's flags for the current build."""
    folder = kernel.source.parent
    copy = Path(tempfile.mkdtemp(prefix=f"{kernel.source.stem}-{revision}-"))
    source = copy / kernel.source.name
    source.write_bytes(file_at_revision(folder / source.name, revision))
    for header in c_loader.included_headers(source.read_bytes()):
        (copy / header).write_bytes(file_at_revision(folder / header, revision))
    library = c_loader.build(source, kernel.arch() or [], kernel.signatures)
    if library is None:
        raise SystemExit(f"{kernel.source.name} at {revision} does not build here (see the log)")
    return library


def module_at_revision(path: Path, revision: str) -> types.ModuleType:
    """The Python module at ``path`` as it was at git ``revision``, loaded beside the current one
    under a name of its own; what it imports is today's code."""
    source = file_at_revision(path, revision)
    module = types.ModuleType(f"{path.stem}_at_{revision}")
    sys.modules[module.__name__] = module  # where dataclasses look up the module's names
    exec(compile(source, f"{revision}:{path.name}", "exec"), module.__dict__)
    return module


def file_at_revision(path: Path, revision: str) -> bytes:
    """The bytes of the file at ``path`` as git ``revision`` holds them."""
    return subprocess.run(
        ["git", "-C", str(path.parent), "show", f"{revision}:./{path.name}"],
        capture_output=True,
        check=True,
    ).stdout
