"""Start, check and stop the long-running daemons of the control plane."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path


def spawn(
    argv: list[str], log: Path, *, env: dict[str, str] | None = None, cwd: Path | None = None
) -> int:
    """Start ``argv`` detached in its own session, output appended to ``log``; return its pid."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
            cwd=cwd,
        )
    return proc.pid


def alive(pid: int) -> bool:
    """Whether ``pid`` runs and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _reap(pid: int) -> None:
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def stop(pid: int, grace: float) -> None:
    """SIGTERM the process group of ``pid``, SIGKILL it after ``grace`` seconds."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            _reap(pid)
            if not alive(pid):
                return
            time.sleep(0.1)


def unmount_under(root: Path) -> None:
    """Lazily unmount every mount point below ``root``, the deepest first."""
    prefix = f"{root.resolve()}/"
    mounts = [
        line.split()[1].encode().decode("unicode_escape")
        for line in Path("/proc/self/mounts").read_text().splitlines()
    ]
    for target in sorted((m for m in mounts if m.startswith(prefix)), key=len, reverse=True):
        subprocess.run(["umount", "--lazy", target], capture_output=True, check=False)
