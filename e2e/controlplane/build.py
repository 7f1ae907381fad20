"""Build etcd, the Kubernetes binaries, CoreDNS, crictl, pause and helm from the Go module proxy.

Each component is built from a small generated wrapper module under
``<cache>/src/<component>-<version>/`` and installed into ``<cache>/bin/<component>-<version>/``.
A finished build leaves a ``.complete`` marker, so later runs only check for it and take
no time at all.

k8s.io/kubernetes cannot be required as an ordinary dependency: its go.mod points every
``k8s.io/<staging>`` module at ``./staging/src/...`` and requires it at v0.0.0. The wrapper
therefore replaces each staging module with the published ``v0.<minor>.<patch>`` tag of the
same release, read from the upstream go.mod so the list never goes stale.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from . import versions
from .locking import locked

KUBE_COMMANDS = (
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kubelet",
    "kube-proxy",
)
# CoreDNS with only the plugins the cluster's Corefile uses (in CoreDNS's own plugin order):
# the full plugin set pulls in every cloud SDK and doubles the build.
COREDNS_PLUGINS = ("ready", "health", "errors", "cache", "kubernetes", "forward")


class BuildError(RuntimeError):
    """A component could not be downloaded or compiled."""


@dataclass(frozen=True)
class Binaries:
    """Paths of every binary the control plane and the tests need."""

    etcd: Path
    kube_apiserver: Path
    kube_controller_manager: Path
    kube_scheduler: Path
    kubelet: Path
    kube_proxy: Path
    coredns: Path
    crictl: Path
    pause: Path
    helm: Path


def _log(msg: str) -> None:
    print(f"[e2e build] {msg}", file=sys.stderr, flush=True)


def _go_env() -> dict[str, str]:
    # go build runs one compiler per core (GOMAXPROCS), which keeps a 2-core runner usable.
    return dict(os.environ, CGO_ENABLED="0", GOFLAGS="-mod=mod -buildvcs=false")


def _go(args: list[str], cwd: Path, what: str) -> None:
    if shutil.which("go") is None:
        raise BuildError(
            "the `go` toolchain is not on PATH; it is needed to build the e2e binaries"
        )
    started = time.monotonic()
    proc = subprocess.run(
        ["go", *args], cwd=cwd, env=_go_env(), capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise BuildError(
            f"{what} failed (go {' '.join(args[:2])} in {cwd}):\n{proc.stderr[-6000:]}"
        )
    _log(f"{what}: {time.monotonic() - started:.0f}s")


def _download(cwd: Path, what: str) -> None:
    """Resolve and fetch every module first, so a missing one fails before compiling."""
    try:
        _go(["mod", "tidy"], cwd, f"download modules for {what}")
    except BuildError as err:
        missing = re.findall(r"(\S+@\S+): (?:reading|verifying|invalid version)[^\n]*", str(err))
        hint = f"cannot download {', '.join(sorted(set(missing)))}\n" if missing else ""
        raise BuildError(f"{hint}{err}") from None


def staging_modules(kube_version: str) -> list[str]:
    """The k8s.io staging modules that k8s.io/kubernetes@kube_version replaces locally."""
    module = f"k8s.io/kubernetes@{kube_version}"
    proc = subprocess.run(
        ["go", "mod", "download", "-json", module],
        env=_go_env(), capture_output=True, text=True, check=False,
    )  # fmt: skip
    info = json.loads(proc.stdout or "{}")
    if proc.returncode != 0 or "GoMod" not in info:
        raise BuildError(f"cannot download {module}: {info.get('Error') or proc.stderr.strip()}")
    gomod = Path(info["GoMod"]).read_text()
    return re.findall(r"^\s*(k8s\.io/[\w.-]+) => \./staging/", gomod, re.MULTILINE)


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _tools_go(imports: list[str]) -> str:
    """A build-tagged file that makes `go mod tidy` pin the modules of the commands."""
    lines = "\n".join(f'\t_ "{imp}"' for imp in imports)
    return f"//go:build tools\n\npackage tools\n\nimport (\n{lines}\n)\n"


def _bin_dir(component: str, version: str) -> Path:
    return versions.cache_dir() / "bin" / f"{component}-{version}"


def bin_dirs() -> list[Path]:
    """Where the pinned versions' binaries are (or will be) installed."""
    return [
        _bin_dir("kubernetes", versions.KUBERNETES),
        _bin_dir("etcd", versions.ETCD),
        _bin_dir("helm", versions.HELM),
        _bin_dir("cri-tools", versions.CRI_TOOLS),
    ]


def crictl_path() -> Path:
    return _bin_dir("cri-tools", versions.CRI_TOOLS) / "crictl"


def kube_proxy_path() -> Path:
    return _bin_dir("kubernetes", versions.KUBERNETES) / "kube-proxy"


def _src_dir(component: str, version: str) -> Path:
    return versions.cache_dir() / "src" / f"{component}-{version}"


def _is_built(out: Path, *binaries: str) -> bool:
    """Finished, and (for a component that gained binaries since) holding each of them."""
    return (out / ".complete").exists() and all((out / name).exists() for name in binaries)


def _finish(out: Path) -> None:
    (out / ".complete").write_text(dt.datetime.now(dt.UTC).isoformat())


def build_kubernetes(version: str = versions.KUBERNETES) -> Path:
    out = _bin_dir("kubernetes", version)
    if _is_built(out, *KUBE_COMMANDS):
        return out
    src = _src_dir("kubernetes", version)
    major, minor, patch = version.lstrip("v").split(".")
    replaces = "\n".join(f"\t{mod} => {mod} v0.{minor}.{patch}" for mod in staging_modules(version))
    _write(
        src / "go.mod",
        f"module llmpool.local/e2e/kubernetes\n\ngo 1.23.0\n\n"
        f"require k8s.io/kubernetes {version}\n\nreplace (\n{replaces}\n)\n",
    )
    cmds = [f"k8s.io/kubernetes/cmd/{c}" for c in KUBE_COMMANDS]
    _write(src / "tools.go", _tools_go(cmds))
    _download(src, f"kubernetes {version}")
    build_date = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    pkg = "k8s.io/component-base/version"
    ldflags = " ".join(
        [
            "-s -w",
            f"-X {pkg}.gitVersion={version}",
            f"-X {pkg}.gitMajor={major}",
            f"-X {pkg}.gitMinor={minor}",
            f"-X {pkg}.gitTreeState=clean",
            f"-X {pkg}.buildDate={build_date}",
        ]
    )
    out.mkdir(parents=True, exist_ok=True)
    _go(
        ["build", "-trimpath", "-ldflags", ldflags, "-o", str(out), *cmds],
        src,
        f"compile {', '.join(KUBE_COMMANDS)}",
    )
    _finish(out)
    return out


def build_etcd(version: str = versions.ETCD) -> Path:
    main_go = (
        "// Command etcd runs the etcd server from go.etcd.io/etcd/server/v3.\n"
        'package main\n\nimport (\n\t"os"\n\n\t"go.etcd.io/etcd/server/v3/etcdmain"\n)\n\n'
        "func main() { etcdmain.Main(os.Args) }\n"
    )
    return _build_main("etcd", version, f"go.etcd.io/etcd/server/v3 {version}", main_go, "etcd")


def _build_command(
    component: str, version: str, module: str, cmd: str, binary: str, ldflags: str
) -> Path:
    """Build the command at ``module/cmd`` (a main package of a required module)."""
    package = f"{module}/{cmd}"
    tools = {"tools.go": _tools_go([package])}
    return _build_module(component, version, f"{module} {version}", tools, package, binary, ldflags)


def build_helm(version: str = versions.HELM) -> Path:
    ldflags = f"-s -w -X helm.sh/helm/v3/internal/version.version={version}"
    return _build_command("helm", version, "helm.sh/helm/v3", "cmd/helm", "helm", ldflags)


def _build_main(
    component: str, version: str, require: str, main_go: str, binary: str, ldflags: str = "-s -w"
) -> Path:
    """Build one command from a generated ``main.go`` in a module that requires ``require``."""
    files = {"main.go": main_go}
    return _build_module(component, version, require, files, ".", binary, ldflags)


def _build_module(
    component: str, version: str, require: str, files: dict[str, str], package: str,
    binary: str, ldflags: str,
) -> Path:  # fmt: skip
    """Build ``package`` as ``binary`` in a generated module that requires ``require`` (none
    when empty) and holds ``files``; a component already built is left as it is."""
    out = _bin_dir(component, version)
    if _is_built(out, binary):
        return out
    src = _src_dir(component, version)
    module = f"module llmpool.local/e2e/{component}\n\ngo 1.23.0\n"
    _write(src / "go.mod", module + (f"\nrequire {require}\n" if require else ""))
    for name, text in files.items():
        _write(src / name, text)
    _download(src, f"{component} {version}")
    out.mkdir(parents=True, exist_ok=True)
    _go(
        ["build", "-trimpath", "-ldflags", ldflags, "-o", str(out / binary), package],
        src,
        f"compile {binary}",
    )
    _finish(out)
    return out


def build_coredns(version: str = versions.COREDNS) -> Path:
    imports = "\n".join(f'\t_ "github.com/coredns/coredns/plugin/{p}"' for p in COREDNS_PLUGINS)
    directives = ", ".join(f'"{p}"' for p in COREDNS_PLUGINS)
    main_go = (
        "// Command coredns is CoreDNS with the plugins the e2e cluster's Corefile uses.\n"
        "package main\n\nimport (\n"
        '\t"github.com/coredns/coredns/core/dnsserver"\n'
        '\t"github.com/coredns/coredns/coremain"\n'
        f"{imports}\n)\n\n"
        f"func init() {{ dnsserver.Directives = []string{{{directives}}} }}\n\n"
        "func main() { coremain.Run() }\n"
    )
    return _build_main(
        "coredns", version, f"github.com/coredns/coredns {version}", main_go, "coredns"
    )


def build_crictl(version: str = versions.CRI_TOOLS) -> Path:
    ldflags = f"-s -w -X sigs.k8s.io/cri-tools/pkg/version.Version={version}"
    return _build_command(
        "cri-tools", version, "sigs.k8s.io/cri-tools", "cmd/crictl", "crictl", ldflags
    )


PAUSE_GO = """// Command pause holds a pod's namespaces open: it sleeps until SIGINT or SIGTERM and reaps
// the zombies that end up with it (it is PID 1 of the pod when the PID namespace is shared).
package main

import (
\t"os"
\t"os/signal"
\t"syscall"
)

func main() {
\tstop := make(chan os.Signal, 1)
\tsignal.Notify(stop, syscall.SIGINT, syscall.SIGTERM)
\tchildren := make(chan os.Signal, 1)
\tsignal.Notify(children, syscall.SIGCHLD)
\tfor {
\t\tselect {
\t\tcase <-stop:
\t\t\treturn
\t\tcase <-children:
\t\t\tfor {
\t\t\t\tvar status syscall.WaitStatus
\t\t\t\tif pid, err := syscall.Wait4(-1, &status, syscall.WNOHANG, nil); pid <= 0 || err != nil {
\t\t\t\t\tbreak
\t\t\t\t}
\t\t\t}
\t\t}
\t}
}
"""


def build_pause(tag: str = versions.PAUSE_TAG) -> Path:
    return _build_main("pause", tag, "", PAUSE_GO, "pause")


def ensure_binaries() -> Binaries:
    """Build whatever is missing from the cache and return the binary paths."""
    started = time.monotonic()
    with locked(versions.cache_dir() / ".lock"):
        etcd = build_etcd()
        kube = build_kubernetes()
        coredns = build_coredns()
        crictl = build_crictl()
        pause = build_pause()
        helm = build_helm()
    _log(f"binaries ready in {time.monotonic() - started:.0f}s under {versions.cache_dir()}")
    return Binaries(
        etcd=etcd / "etcd",
        kube_apiserver=kube / "kube-apiserver",
        kube_controller_manager=kube / "kube-controller-manager",
        kube_scheduler=kube / "kube-scheduler",
        kubelet=kube / "kubelet",
        kube_proxy=kube / "kube-proxy",
        coredns=coredns / "coredns",
        crictl=crictl / "crictl",
        pause=pause / "pause",
        helm=helm / "helm",
    )
