"""The kubelet's HTTPS endpoint, enough for `kubectl logs`.

The apiserver proxies ``kubectl logs`` to ``https://<node InternalIP>:<kubelet port>/
containerLogs/<namespace>/<pod>/<container>`` with its kubelet client certificate; this
server checks that certificate against the cluster CA and returns the container's log file
(``tailLines``, ``limitBytes`` and ``follow`` supported).
"""

from __future__ import annotations

import ssl
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

# (namespace, pod, container) -> (log file, whether the container may still write to it)
LogFinder = Callable[[str, str, str], tuple[Path, bool] | None]


def _tail(data: bytes, lines: int) -> bytes:
    parts = data.splitlines(keepends=True)
    return b"".join(parts[-lines:]) if lines > 0 else b""


def make_handler(find: LogFinder) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            pass

        def do_GET(self) -> None:  # noqa: N802
            url = urlparse(self.path)
            parts = url.path.strip("/").split("/")
            if url.path == "/healthz":
                self._send(b"ok")
                return
            if len(parts) != 4 or parts[0] != "containerLogs":
                self.send_error(404)
                return
            found = find(parts[1], parts[2], parts[3])
            if found is None:
                self.send_error(404, "container not found on this node")
                return
            path, live = found
            query = parse_qs(url.query)
            data = path.read_bytes() if path.exists() else b""
            if "tailLines" in query:
                data = _tail(data, int(query["tailLines"][0]))
            if "limitBytes" in query:
                data = data[: int(query["limitBytes"][0])]
            if query.get("follow", ["false"])[0] == "true" and live:
                self._follow(path, data, find, parts[1:])
            else:
                self._send(data)

        def _send(self, data: bytes) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _follow(self, path: Path, first: bytes, find: LogFinder, key: list[str]) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.end_headers()
            self.wfile.write(first)
            offset = path.stat().st_size if path.exists() else 0
            try:
                while (found := find(*key)) is not None and found[1]:
                    size = path.stat().st_size if path.exists() else 0
                    if size > offset:
                        with path.open("rb") as f:
                            f.seek(offset)
                            self.wfile.write(f.read(size - offset))
                        self.wfile.flush()
                        offset = size
                    time.sleep(0.5)
            except (BrokenPipeError, ConnectionResetError):
                pass

    return Handler


def serve(
    host: str, port: int, cert: Path, key: Path, client_ca: Path, find: LogFinder
) -> ThreadingHTTPServer:
    """Start the endpoint in a daemon thread."""
    server = ThreadingHTTPServer((host, port), make_handler(find))
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(str(cert), str(key))
    ctx.load_verify_locations(str(client_ca))
    ctx.verify_mode = ssl.CERT_REQUIRED
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True, name="kubelet-server").start()
    return server
