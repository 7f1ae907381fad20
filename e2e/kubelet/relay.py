"""A TCP relay from the pod-network gateway to the apiserver on loopback.

The control plane listens on 127.0.0.1 only, which a pod's network namespace cannot reach.
The relay listens on ``POD_GATEWAY:<apiserver port>`` and forwards bytes unchanged (TLS
passes through end to end), so in-pod clients use KUBERNETES_SERVICE_HOST=POD_GATEWAY.
"""

from __future__ import annotations

import asyncio
import logging
import threading

log = logging.getLogger(__name__)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


class Relay:
    def __init__(self, listen_host: str, port: int, target_host: str = "127.0.0.1") -> None:
        self.listen_host, self.port, self.target_host = listen_host, port, target_host
        self._ready = threading.Event()
        self._loop = asyncio.new_event_loop()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(self.target_host, self.port)
        except OSError as err:
            log.warning("relay: cannot reach %s:%s: %s", self.target_host, self.port, err)
            writer.close()
            return
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))

    async def _serve(self) -> None:
        server = await asyncio.start_server(self._handle, self.listen_host, self.port)
        self._ready.set()
        async with server:
            await server.serve_forever()

    def start(self) -> None:
        """Serve in a daemon thread; returns once listening."""
        thread = threading.Thread(
            target=self._loop.run_until_complete, args=(self._serve(),), daemon=True, name="relay"
        )
        thread.start()
        if not self._ready.wait(10):
            raise RuntimeError(f"relay did not start listening on {self.listen_host}:{self.port}")
