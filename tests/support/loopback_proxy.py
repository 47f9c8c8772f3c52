"""The part every test proxy on loopback shares: a listener on a free port of 127.0.0.1, a
connection to ``target`` per accepted client, the live sockets (shut down when the proxy
stops, which ends every link's threads), and a context manager around it all. A subclass says
what one accepted pair of sockets does (:meth:`LoopbackProxy._link`) and, optionally, which
clients it turns away (:meth:`LoopbackProxy._admit`)."""

from __future__ import annotations

import socket
import threading
from contextlib import suppress
from types import TracebackType
from typing import Self


class LoopbackProxy:
    """Forward ``127.0.0.1:<port>`` to ``target``, one link per client connection."""

    def __init__(self, target: tuple[str, int], *, name: str) -> None:
        self.target = target
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._thread = threading.Thread(target=self._accept, name=name, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        with suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        for sock in self._live():
            with suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # the links' threads see the end and close
        self._thread.join(30)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            if not self._admit(client):
                close(client)
                continue
            try:
                server = socket.create_connection(self.target)
            except OSError:
                close(client)
                continue
            for sock in (client, server):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._sockets.update((client, server))
            self._link(client, server)

    def _admit(self, client: socket.socket) -> bool:
        """Whether to serve this client (it is closed otherwise)."""
        return True

    def _link(self, client: socket.socket, server: socket.socket) -> None:
        """Start relaying between ``client`` and its ``server`` connection (threads)."""
        raise NotImplementedError

    def _live(self) -> list[socket.socket]:
        with self._lock:
            return list(self._sockets)

    def _forget(self, *socks: socket.socket) -> None:
        with self._lock:
            self._sockets.difference_update(socks)


def close(sock: socket.socket) -> None:
    """Shut a socket down (waking a thread blocked on it) and close it."""
    with suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with suppress(OSError):
        sock.close()
