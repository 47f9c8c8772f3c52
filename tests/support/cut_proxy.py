"""A TCP proxy on loopback that cuts a connection right after the server ran a statement.

Between a store and PostgreSQL (or PgBouncer) it forwards bytes both ways, unchanged. Armed
with a marker (``proxy.arm(b"INSERT INTO messages")``), the first request from the client
whose bytes contain the marker is forwarded whole; then the server's answer is read up to its
ReadyForQuery message (the statement ran, and outside a transaction committed) and, instead of
being relayed, both sockets are closed: the client sees its connection lost with the write
landed, the one case where only the server knows the outcome. ``fired`` is set when it cut.

Armed with ``refuse_after=True`` the proxy also refuses every connection from the cut on.
``refuse()`` makes the database unreachable: live connections are closed and every new one is
closed as soon as it is accepted (nothing reaches the server). ``restore()`` undoes it.

Requests are matched on the SQL text the driver sends, so a store behind it should not
prepare statements (``?prepare_threshold=none``: a prepared statement's later runs carry only
its name) nor encrypt (``sslmode=disable``).
"""

from __future__ import annotations

import socket
import threading
from contextlib import suppress
from types import TracebackType

#: ReadyForQuery: type byte, length 5, then the transaction status (idle, in a transaction,
#: failed transaction).
_READY = tuple(b"Z\x00\x00\x00\x05" + status for status in (b"I", b"T", b"E"))


class CutProxy:
    """Forward ``127.0.0.1:<port>`` to ``target``; cut where armed (see the module)."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.fired = threading.Event()
        self._marker: bytes | None = None
        self._refusing = False
        self._refuse_after = False
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._thread = threading.Thread(target=self._accept, name="cut-proxy", daemon=True)

    def __enter__(self) -> CutProxy:
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
        self._close_all()
        self._thread.join(timeout=5)

    def arm(self, marker: bytes, *, refuse_after: bool = False) -> None:
        """Cut the next request that contains ``marker``, after the server answered it;
        ``refuse_after``: and from then on refuse every connection (as :meth:`refuse`), so the
        server stays unreachable until :meth:`restore`."""
        with self._lock:
            self.fired.clear()
            self._marker = marker
            self._refuse_after = refuse_after

    def refuse(self) -> None:
        """Close every live connection and every new one at once: the server is unreachable."""
        with self._lock:
            self._refusing = True
        self._close_all()

    def restore(self) -> None:
        with self._lock:
            self._refusing = False

    def _close_all(self) -> None:
        with self._lock:
            live = list(self._sockets)
        for sock in live:
            _close(sock)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                refusing = self._refusing
            if refusing:
                _close(client)
                continue
            try:
                server = socket.create_connection(self.target)
            except OSError:
                _close(client)
                continue
            with self._lock:
                self._sockets.update((client, server))
            pair = _Pair(self, client, server)
            threading.Thread(target=pair.to_server, daemon=True).start()
            threading.Thread(target=pair.to_client, daemon=True).start()

    def _take_marker(self, data: bytes) -> bool:
        """Whether ``data`` is the armed request (disarming it)."""
        with self._lock:
            marker = self._marker
            if marker is None or marker not in data:
                return False
            self._marker = None
            if self._refuse_after:  # set before the cut: no reconnection slips through
                self._refusing = True
            return True

    def _forget(self, *socks: socket.socket) -> None:
        with self._lock:
            self._sockets.difference_update(socks)


class _Pair:
    """One client connection and its server connection."""

    def __init__(self, proxy: CutProxy, client: socket.socket, server: socket.socket) -> None:
        self.proxy = proxy
        self.client = client
        self.server = server
        self.cutting = threading.Event()  # the server's answer is no longer relayed

    def to_server(self) -> None:
        try:
            while True:
                data = self.client.recv(65536)
                if not data:
                    break
                if not self.cutting.is_set() and self.proxy._take_marker(data):
                    self.cutting.set()  # to_client reads the answer and cuts
                self.server.sendall(data)
        except OSError:
            pass
        self._end()

    def to_client(self) -> None:
        answer = b""
        try:
            while True:
                data = self.server.recv(65536)
                if not data:
                    break
                if self.cutting.is_set():
                    answer += data
                    if answer.endswith(_READY):  # the statement ran (and committed)
                        self.proxy.fired.set()  # before the client can see the cut
                        self._end()
                        return
                    continue
                self.client.sendall(data)
        except OSError:
            pass
        self._end()

    def _end(self) -> None:
        _close(self.client)
        _close(self.server)
        self.proxy._forget(self.client, self.server)


def _close(sock: socket.socket) -> None:
    with suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with suppress(OSError):
        sock.close()
