"""Real TCP servers on loopback that misbehave on purpose, for the Redis tier's tests and
native mode's: a base listener, and a proxy in front of a real redis-server that stalls
in the middle of a reply."""

from __future__ import annotations

import contextlib
import select
import socket
import threading


class LoopbackServer:
    """A TCP listener on loopback handing each connection to `handle` on its own thread."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.stop = threading.Event()
        self._acceptor = threading.Thread(target=self._accept, daemon=True)
        self._acceptor.start()

    def _accept(self) -> None:
        self.listener.settimeout(0.2)
        while not self.stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            threading.Thread(target=self.handle, args=(conn,), daemon=True).start()

    def handle(self, conn: socket.socket) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self.stop.set()
        self._acceptor.join()
        self.listener.close()


class StallingProxy(LoopbackServer):
    """A loopback TCP proxy in front of a real redis-server. Once armed, it forwards only
    `budget` more bytes from the server, then holds the rest until released: a server (or
    network) that stalls in the middle of a value."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream = upstream_port
        self.budget: int | None = None
        self.released = threading.Event()
        super().__init__()

    def handle(self, client: socket.socket) -> None:
        server = socket.create_connection(("127.0.0.1", self.upstream))
        with client, server, contextlib.suppress(OSError):  # either side may hang up
            while not self.stop.is_set():
                ready, _, _ = select.select([client, server], [], [], 0.2)
                for src in ready:
                    data = src.recv(65536)
                    if not data:
                        return
                    if src is server and self.budget is not None:
                        if len(data) > self.budget:
                            head, data = data[:self.budget], data[self.budget:]
                            client.sendall(head)
                            self.budget = 0
                            self.released.wait(60)
                        else:
                            self.budget -= len(data)
                    (client if src is server else server).sendall(data)

    def close(self) -> None:
        self.released.set()
        super().close()
