"""A TCP proxy on loopback that adds network latency and counts round trips.

PostgreSQL over a real network costs 0.3-1 ms or more per round trip; on loopback the cost is
invisible, so a store that talks to the server five times per write looks as fast as one that
talks once. Put this proxy between the store and the server to see (and count) the difference:

    with LatencyProxy(("127.0.0.1", 5432), delay=0.005) as proxy:
        url = pg_url.set(host="127.0.0.1", port=proxy.port)
        ...
        proxy.round_trips  # client requests that waited for an answer

Each chunk is forwarded after ``delay`` seconds in each direction, in order. A round trip is a
burst of client bytes sent after the server last answered (or as the connection's first bytes):
what a client that waits for each answer pays once per request.
"""

from __future__ import annotations

import asyncio
import threading
from types import TracebackType


class LatencyProxy:
    """Forward ``127.0.0.1:<port>`` to ``target`` with ``delay`` seconds each way."""

    def __init__(self, target: tuple[str, int], *, delay: float) -> None:
        self.target = target
        self.delay = delay
        self.port = 0
        self.round_trips = 0
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="latency-proxy", daemon=True)
        self._server: asyncio.Server | None = None

    def __enter__(self) -> LatencyProxy:
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("the latency proxy did not start")
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)

    def reset(self) -> int:
        """The round trips counted so far; the count starts again at 0."""
        with self._lock:
            count, self.round_trips = self.round_trips, 0
        return count

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._handle, "127.0.0.1", 0)
        )
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()
        self._server.close()
        for task in asyncio.all_tasks(self._loop):
            task.cancel()
        self._loop.run_until_complete(asyncio.sleep(0))
        self._loop.close()

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        server_r, server_w = await asyncio.open_connection(*self.target)
        answered = [True]  # the server spoke last (or nobody yet): the next request is a trip

        async def pump(
            reader: asyncio.StreamReader, writer: asyncio.StreamWriter, upstream: bool
        ) -> None:
            """Read as fast as data comes; deliver each chunk ``delay`` after it arrived."""
            chunks: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

            async def deliver() -> None:
                while True:
                    arrived, data = await chunks.get()
                    if not data:
                        break
                    await asyncio.sleep(max(0.0, arrived + self.delay - self._loop.time()))
                    writer.write(data)
                    await writer.drain()

            delivery = asyncio.ensure_future(deliver())
            try:
                while data := await reader.read(65536):
                    if upstream and answered[0]:
                        with self._lock:
                            self.round_trips += 1
                    answered[0] = not upstream
                    chunks.put_nowait((self._loop.time(), data))
                chunks.put_nowait((self._loop.time(), b""))
                await delivery
            except (ConnectionError, asyncio.CancelledError):
                delivery.cancel()
            finally:
                writer.close()

        await asyncio.gather(pump(client_r, server_w, True), pump(server_r, client_w, False))
