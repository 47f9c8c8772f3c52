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

from tests.support.loopback_proxy import LoopbackProxy, close

#: ReadyForQuery: type byte, length 5, then the transaction status (idle, in a transaction,
#: failed transaction).
_READY = tuple(b"Z\x00\x00\x00\x05" + status for status in (b"I", b"T", b"E"))


class CutProxy(LoopbackProxy):
    """Forward ``127.0.0.1:<port>`` to ``target``; cut where armed (see the module)."""

    def __init__(self, target: tuple[str, int]) -> None:
        super().__init__(target, name="cut-proxy")
        self.fired = threading.Event()
        self._marker: bytes | None = None
        self._refusing = False
        self._refuse_after = False

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
        for sock in self._live():
            close(sock)

    def _admit(self, client: socket.socket) -> bool:
        with self._lock:
            return not self._refusing

    def _link(self, client: socket.socket, server: socket.socket) -> None:
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
        close(self.client)
        close(self.server)
        self.proxy._forget(self.client, self.server)
