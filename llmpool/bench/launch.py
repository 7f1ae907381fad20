"""Start ``llmpool serve`` on a free local port for a benchmark, and wait until it is ready."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

LLMPOOL = str(Path(sys.executable).parent / "llmpool")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_server(
    args: list[str], log: Path, env: dict[str, str] | None = None, timeout: float = 600
) -> tuple[subprocess.Popen[bytes], str]:
    """``llmpool serve ARGS`` on 127.0.0.1, output to ``log``; its process and base URL once
    ``/ready`` answers 200 (RuntimeError with the log's tail if it exits or times out)."""
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
            if httpx.get(f"{url}/ready", timeout=5).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    process.kill()
    raise RuntimeError(f"llmpool serve was not ready after {timeout:.0f}s: {log}")
