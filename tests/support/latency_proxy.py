"""A TCP proxy on loopback that adds network latency and counts round trips.

PostgreSQL over a real network costs 0.3-1 ms or more per round trip; on loopback the cost is
invisible, so a store that talks to the server five times per write looks as fast as one that
talks once. Put this proxy between the store and the server to see (and count) the difference:

    with LatencyProxy(("127.0.0.1", 5432), delay=0.005) as proxy:
        url = pg_url.set(host="127.0.0.1", port=proxy.port)
        ...
        proxy.round_trips  # client requests that waited for an answer

Each chunk is forwarded ``delay`` seconds after it arrived, in each direction, in order (a
chunk arriving while an earlier one waits is not delayed twice: a pipe, not a queue of
sleeps). A round trip is a burst of client bytes sent after the server last answered (or as
the connection's first bytes): what a client that waits for each answer pays once per request.

Plain threads and ``time.sleep`` (a nanosleep): an event loop's timers wake up to 1 ms late
(epoll's millisecond timeout is rounded up), which added 0.6-0.8 ms to every hop.
"""

from __future__ import annotations

import queue
import socket
import threading
import time
from contextlib import suppress

from tests.support.loopback_proxy import LoopbackProxy


class LatencyProxy(LoopbackProxy):
    """Forward ``127.0.0.1:<port>`` to ``target`` with ``delay`` seconds each way."""

    def __init__(self, target: tuple[str, int], *, delay: float) -> None:
        super().__init__(target, name="latency-proxy")
        self.delay = delay
        self.round_trips = 0

    def reset(self) -> int:
        """The round trips counted so far; the count starts again at 0."""
        with self._lock:
            count, self.round_trips = self.round_trips, 0
        return count

    def _link(self, client: socket.socket, server: socket.socket) -> None:
        link = _Link(self, client, server)
        for source, sink, upstream in ((client, server, True), (server, client, False)):
            threading.Thread(target=link.pump, args=(source, sink, upstream), daemon=True).start()


class _Link:
    """One proxied connection: a pump per direction, each with a delivery thread."""

    def __init__(self, proxy: LatencyProxy, client: socket.socket, server: socket.socket) -> None:
        self.proxy = proxy
        self.client, self.server = client, server
        self.answered = True  # the server spoke last (or nobody yet): the next request is a trip
        self.open_directions = 2
        self.lock = threading.Lock()

    def pump(self, source: socket.socket, sink: socket.socket, upstream: bool) -> None:
        """Read as fast as data comes; hand each chunk on with the time it is due."""
        chunks: queue.SimpleQueue[tuple[float, bytes]] = queue.SimpleQueue()
        delivery = threading.Thread(target=self._deliver, args=(chunks, sink), daemon=True)
        delivery.start()
        proxy = self.proxy
        try:
            while data := source.recv(65536):
                if upstream and self.answered:
                    with proxy._lock:
                        proxy.round_trips += 1
                self.answered = not upstream
                chunks.put((time.monotonic() + proxy.delay, data))
        except OSError:
            pass  # reset or shut down: end this direction like an end of stream
        chunks.put((0.0, b""))
        delivery.join()
        with self.lock:
            self.open_directions -= 1
            done = self.open_directions == 0
        if done:
            proxy._forget(self.client, self.server)
            self.client.close()
            self.server.close()

    @staticmethod
    def _deliver(chunks: queue.SimpleQueue[tuple[float, bytes]], sink: socket.socket) -> None:
        while True:
            due, data = chunks.get()
            if not data:
                with suppress(OSError):
                    sink.shutdown(socket.SHUT_WR)
                return
            if (wait := due - time.monotonic()) > 0:
                time.sleep(wait)
            try:
                sink.sendall(data)
            except OSError:
                return  # the other side is gone; the pump ends at its next read
