"""``AsyncSessionDB`` behind a sync face, so the contract tests run through it unchanged.

Each call is a coroutine awaited on one event loop (in a thread of its own), always by the
same long-lived task: a ``transaction()`` opened by one call is the task's for the calls that
follow, as in an application. Attributes that are not part of the async API (``engine``,
``uow``, ``is_sqlite``: the tests' inspection tools) come from a sync ``SessionDB`` on the same
database (on SQLite it shares the file's writer with the async store).
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from functools import partial
from typing import Any

from hermes_store import AsyncSessionDB, SessionDB
from hermes_store.engine.factory import Target, autocommit_engine

_STREAMS = ("iter_messages", "iter_export")


class AsyncDriver:
    """Runs every ``AsyncSessionDB`` coroutine to completion for a sync caller."""

    def __init__(self, target: Target, **options: Any) -> None:
        self._target = target
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._queue: asyncio.Queue[Any] = self._submit_raw(_make_queue).result()
        self._server = asyncio.run_coroutine_threadsafe(self._serve(), self._loop)
        self.adb = AsyncSessionDB(target, **options)
        self._inspector: SessionDB | None = None

    @staticmethod
    def _noop() -> None:
        return None

    def _submit_raw(self, fn: Callable[[], Any]) -> Future[Any]:
        async def run() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self._loop)

    async def _serve(self) -> None:
        while True:
            make, done = await self._queue.get()
            if make is None:
                return
            try:
                result = await make()
            except BaseException as error:
                done.set_exception(error)
            else:
                done.set_result(result)

    def _do(self, make: Callable[[], Awaitable[Any]]) -> Any:
        done: Future[Any] = Future()
        self._loop.call_soon_threadsafe(self._queue.put_nowait, (make, done))
        return done.result()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if name in _STREAMS:
            return self._stream(name)
        if name == "transaction":
            return self._transaction
        attr = getattr(AsyncSessionDB, name, None)
        if inspect.iscoroutinefunction(attr):
            return lambda *a, **k: self._do(lambda: getattr(self.adb, name)(*a, **k))
        if attr is not None:
            return getattr(self.adb, name)
        return getattr(self.inspector, name)

    @property
    def inspector(self) -> SessionDB:
        if self._inspector is None:
            self._inspector = SessionDB(self._target)
        return self._inspector

    @property
    def statement_engines(self) -> tuple[Any, ...]:
        """Every engine whose events see the store's statements (the async store's own)."""
        own = self._do(lambda: self.adb.run_sync(lambda db: db.engine))
        engines = [own] if own is self.inspector.engine else [own, self.inspector.engine]
        if own.dialect.name == "postgresql":  # reads outside a unit run on the autocommit twin
            engines.append(autocommit_engine(own))
        return tuple(engines)

    def _stream(self, name: str) -> Callable[..., Iterator[Any]]:
        def generate(*args: Any, **kwargs: Any) -> Iterator[Any]:
            agen = getattr(self.adb, name)(*args, **kwargs)
            try:
                while True:
                    try:
                        yield self._do(agen.__anext__)
                    except StopAsyncIteration:
                        return
            finally:
                self._do(agen.aclose)

        return generate

    @contextmanager
    def _transaction(self) -> Iterator[None]:
        block = self.adb.transaction()
        self._do(block.__aenter__)
        try:
            yield None
        except BaseException as error:
            leave = partial(block.__aexit__, type(error), error, error.__traceback__)
            if not self._do(leave):
                raise
        else:
            self._do(lambda: block.__aexit__(None, None, None))

    def close(self) -> None:
        self._do(self.adb.close)

    def shutdown(self) -> None:
        """Close the async store, its inspector and the loop."""
        try:
            self.close()
            if self._inspector is not None:
                self._inspector.close()
        finally:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, (None, None))
            self._server.result()
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()

    def __enter__(self) -> AsyncDriver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _make_queue() -> asyncio.Queue[Any]:
    return asyncio.Queue()
