"""Start what a benchmark measures: an engine built off the main thread, or ``llmpool serve``
on a free local port.

Why engines are built in a thread that ends: torch's first parallel op in a thread creates that
thread's OpenMP team. Loading and warming a model in the main thread and then stepping it there
is fine, but a benchmark that also steps an engine from a second thread (or compares with the
server, whose engine thread steps) would hold two teams; with as many intra-op threads as cores
that costs about 2x per token (GNU OpenMP's workers stop spinning once the process has more
OpenMP threads than CPUs). Building in a thread that has ended before anything is stepped
leaves the stepping thread's team the process's only one, as in the server
(``engine/server/async_engine.py``).
"""

from __future__ import annotations

import concurrent.futures
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import httpx

LLMPOOL = str(Path(sys.executable).parent / "llmpool")

Built = TypeVar("Built")


def build_in_ended_thread(build: Callable[[], Built]) -> Built:
    """``build()`` run in a thread that has ended when this returns (see the module's note)."""
    with concurrent.futures.ThreadPoolExecutor(1) as builder:
        return builder.submit(build).result()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_server(
    args: list[str], log: Path, env: dict[str, str] | None = None, timeout: float = 600
) -> tuple[subprocess.Popen[bytes], str]:
    """``llmpool serve ARGS`` on 127.0.0.1, output to ``log``; its process and base URL once
    ``/ready`` answers 200 and, with ``--compile``, once the engine runs the compiled decoder
    (it serves eager while compiling); RuntimeError with the log's tail if it exits, its compile
    fails or it times out."""
    port = free_port()
    command = [LLMPOOL, "serve", *args, "--host", "127.0.0.1", "--port", str(port)]
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"llmpool serve exited:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/ready", timeout=5).status_code == 200 and (
                "--compile" not in args or compiled(url)
            ):
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    process.kill()
    raise RuntimeError(f"llmpool serve was not ready after {timeout:.0f}s: {log}")


def compiled(url: str) -> bool:
    """Whether the server at ``url`` has finished compiling its decoder (RuntimeError if the
    compile failed: a benchmark of the compiled engine would measure the eager one)."""
    fingerprint = httpx.get(f"{url}/fingerprint", timeout=60).raise_for_status().json()
    report = fingerprint["observed"]["compile"]
    if report["state"] == "failed":
        raise RuntimeError(f"llmpool serve's compile failed: {report['error']}")
    return bool(report["state"] == "compiled")
