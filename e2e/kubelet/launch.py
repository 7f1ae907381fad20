"""Container entry shim: bind-mount the volumes, change directory, exec the command.

Runs as ``python -I launch.py '<json>'`` inside the container's own mount namespace (made
by ``ip netns exec`` or ``unshare --mount``), so its mounts are visible to the container
process only. Mount points missing on the host are created there, empty. Standard library
only: it must not depend on the pod's environment.
"""

import json
import os
import subprocess
import sys


def _mount(source_fd: int, target: str, read_only: bool) -> None:
    source = f"/proc/self/fd/{source_fd}"
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if not os.path.exists(target):
            open(target, "a").close()
    subprocess.run(["mount", "--bind", source, target], check=True, pass_fds=(source_fd,))
    if read_only:
        subprocess.run(["mount", "-o", "remount,bind,ro", target], check=True)


def main() -> None:
    spec = json.loads(sys.argv[1])
    # Open every source before mounting anything: a volume mounted over a parent of the kubelet's
    # state directory (an emptyDir at /tmp while the state lives under /tmp) would hide the
    # sources of the volumes mounted after it.
    opened = [(os.open(source, os.O_PATH), target, ro) for source, target, ro in spec["mounts"]]
    for source_fd, target, read_only in opened:
        _mount(source_fd, target, read_only)
    if spec.get("workingDir"):
        os.makedirs(spec["workingDir"], exist_ok=True)
        os.chdir(spec["workingDir"])
    argv = spec["argv"]
    os.execvpe(argv[0], argv, os.environ)


if __name__ == "__main__":
    main()
