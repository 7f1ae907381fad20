"""One container: its process, its Kubernetes state and its restart bookkeeping."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .api import Json
from .node import now

LAUNCHER = Path(__file__).with_name("launch.py")
BACKOFF_START, BACKOFF_MAX = 10.0, 300.0
# Exit code and reason that Kubernetes reports when a container's command cannot start.
START_ERROR_EXIT = 128


@dataclass
class Launch:
    """Everything needed to start the container's process."""

    argv: list[str]
    env: dict[str, str]
    mounts: list[tuple[Path, str, bool]]
    working_dir: str | None
    namespace_prefix: list[str]  # runs the launcher in the pod's network + a new mount namespace
    log: Path


@dataclass
class Container:
    spec: Json
    attempts: int = 0  # how many times a process was started (or failed to start)
    state: Json = field(default_factory=lambda: {"waiting": {"reason": "ContainerCreating"}})
    last_state: Json = field(default_factory=dict)
    ready: bool = False
    started: bool = False
    proc: subprocess.Popen[bytes] | None = None
    next_start: float = 0.0  # monotonic time before which a restart waits (back-off)
    env: dict[str, str] = field(default_factory=dict)  # for exec probes

    @property
    def name(self) -> str:
        return self.spec["name"]

    @property
    def restart_count(self) -> int:
        return max(0, self.attempts - 1)

    @property
    def running(self) -> bool:
        return "running" in self.state

    @property
    def terminated(self) -> Json | None:
        return self.state.get("terminated")

    def start(self, launch: Launch) -> None:
        """Start the process; a command that cannot be found ends as StartError."""
        self.attempts += 1
        self.env = launch.env
        program = launch.argv[0]
        if shutil.which(program, path=launch.env.get("PATH")) is None:
            stamp = now()
            self.state = {"terminated": {"exitCode": START_ERROR_EXIT, "reason": "StartError",
                          "message": f"exec: {program!r}: executable file not found in $PATH",
                          "startedAt": stamp, "finishedAt": stamp}}  # fmt: skip
            return
        spec = {"argv": launch.argv, "mounts": [[str(s), t, ro] for s, t, ro in launch.mounts],
                "workingDir": launch.working_dir}  # fmt: skip
        launch.log.parent.mkdir(parents=True, exist_ok=True)
        with launch.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [*launch.namespace_prefix, sys.executable, "-I", str(LAUNCHER), json.dumps(spec)],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                env=launch.env, start_new_session=True,
            )  # fmt: skip
        self.state = {"running": {"startedAt": now()}}
        self.ready = False
        self.started = False

    def poll(self) -> bool:
        """Record the exit of the process; True when it has just exited."""
        if self.proc is None or self.proc.poll() is None:
            return False
        code = self.proc.returncode
        self.proc = None
        started = self.state.get("running", {}).get("startedAt", now())
        if code < 0:
            term = {"exitCode": 128 - code, "signal": -code, "reason": "Error"}
        else:
            term = {"exitCode": code, "reason": "Completed" if code == 0 else "Error"}
        self.state = {"terminated": {**term, "startedAt": started, "finishedAt": now()}}
        self.ready = False
        self.started = False
        return True

    def schedule_restart(self) -> None:
        """Restart at once the first time, then in CrashLoopBackOff: 10 s, doubling, at most 5 min."""
        self.last_state = {"terminated": self.terminated} if self.terminated else self.last_state
        if self.attempts <= 1:
            self.next_start = 0.0
            self.state = {"waiting": {"reason": "ContainerCreating"}}
            return
        delay = min(BACKOFF_MAX, BACKOFF_START * 2 ** min(self.attempts - 2, 10))
        self.next_start = time.monotonic() + delay
        self.state = {"waiting": {"reason": "CrashLoopBackOff",
                      "message": f"back-off {delay:.0f}s restarting failed container={self.name}"}}  # fmt: skip

    def signal(self, sig: signal.Signals) -> None:
        """Signal the container's process group (the process and anything it spawned)."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    def exited(self) -> bool:
        return self.proc is None or self.proc.poll() is not None

    def stop(self, grace: float) -> None:
        """SIGTERM, then SIGKILL after ``grace`` seconds; records the exit."""
        stop_all([self], grace)

    def status(self) -> Json:
        image = self.spec.get("image", "")
        result: Json = {
            "name": self.name, "image": image, "imageID": f"llmpool-e2e://{image}",
            "ready": self.ready, "started": self.started, "restartCount": self.restart_count,
            "state": self.state, "lastState": self.last_state,
        }  # fmt: skip
        if self.proc is not None:
            result["containerID"] = f"llmpool-e2e://{self.proc.pid}"
        return result


def stop_all(containers: list[Container], grace: float) -> None:
    """Terminate containers together: SIGTERM, ``grace`` seconds, SIGKILL, record exits."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        alive = [c for c in containers if not c.exited()]
        for c in alive:
            c.signal(sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and not all(c.exited() for c in alive):
            time.sleep(0.05)
    for c in containers:
        c.poll()
