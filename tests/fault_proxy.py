"""A TCP proxy for fault tests: it passes traffic to a server, or plays that server down or
hanging, switched at any moment (`mode`).

- "pass": bytes go both ways.
- "down": open connections are cut and new ones are closed as soon as they arrive (what a
  client sees of a crashed or unreachable server).
- "stall": open connections are cut (a client's pooled connection cannot slip through), new
  ones are accepted but nothing goes through until the mode changes (a server that stopped
  answering); "pass" then lets the held traffic through.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
from collections.abc import Iterator

MODES = ("pass", "down", "stall")
_TICK_S = 0.05


class FaultProxy:
    def __init__(self, target_host: str, target_port: int):
        self._target = (target_host, target_port)
        self._mode = "pass"
        self._changed = threading.Condition()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(_TICK_S)
        self.port = self._listener.getsockname()[1]
        self.connections = 0  # accepted so far, whatever the mode
        self._open: set[socket.socket] = set()
        self._closing = False
        self._thread = threading.Thread(target=self._accept_loop, daemon=True, name="fault-proxy")
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def mode(self) -> str:
        return self._mode

    @mode.setter
    def mode(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} must be one of {MODES}")
        with self._changed:
            self._mode = mode
            if mode != "pass":
                for s in list(self._open):
                    _close(s)
                self._open.clear()
            self._changed.notify_all()

    def close(self) -> None:
        self._closing = True
        self.mode = "down"
        self._thread.join(timeout=5)
        self._listener.close()

    def _accept_loop(self) -> None:
        while not self._closing:
            try:
                client, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            self.connections += 1
            if self._mode == "down":
                _close(client)
                continue
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        with self._changed:
            self._open.add(client)
            while self._mode == "stall" and not self._closing:
                self._changed.wait(_TICK_S)
            if self._mode == "down" or self._closing:
                self._open.discard(client)
                _close(client)
                return
        try:
            upstream = socket.create_connection(self._target, timeout=5)
        except OSError:
            with self._changed:
                self._open.discard(client)
            _close(client)
            return
        with self._changed:
            self._open.add(upstream)
        try:
            self._pump(client, upstream)
        finally:
            with self._changed:
                self._open.discard(client)
                self._open.discard(upstream)
            _close(client)
            _close(upstream)

    def _pump(self, client: socket.socket, upstream: socket.socket) -> None:
        peers = {client: upstream, upstream: client}
        while not self._closing:
            if self._mode == "stall":
                with self._changed:
                    self._changed.wait(_TICK_S)
                continue
            try:
                readable, _, _ = select.select(list(peers), [], [], _TICK_S)
                for s in readable:
                    data = s.recv(1 << 16)
                    if not data:
                        return
                    peers[s].sendall(data)
            except (OSError, ValueError):  # cut by mode "down", or the peer went away
                return


def _close(s: socket.socket) -> None:
    with contextlib.suppress(OSError):
        s.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        s.close()


@contextlib.contextmanager
def fault_proxy(endpoint: str) -> Iterator[FaultProxy]:
    """A FaultProxy in front of `endpoint` (http://host:port), closed on exit."""
    host, port = endpoint.rsplit("//", 1)[-1].split(":")
    proxy = FaultProxy(host, int(port))
    try:
        yield proxy
    finally:
        proxy.close()
