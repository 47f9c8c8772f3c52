"""``AsyncSessionDB``: the store for asyncio applications; no call blocks the event loop.

Every coroutine runs the real :class:`~hermes_store.store.SessionDB` method (one source of
truth for every statement), off the loop. The coroutines are derived from SessionDB's methods
(one declaration line each, see ``_Twin``): their parameters, defaults and docstrings are the
methods' own, so a parameter added to SessionDB is never missing here.

- PostgreSQL: natively async. The engine is SQLAlchemy's asyncio engine over psycopg's async
  API, and the sync method runs inside ``greenlet_spawn``: each driver round trip awaits on the
  loop, no thread per call. Retry pauses await too (see ``uow._sleep``).
- SQLite (``sqlite3`` only blocks): a bounded pool of threads per store (``max_threads``,
  default 8). They go through the file's shared writer and the process's writer queue, so sync
  and async code in one process cooperate on one file.

``async with db.transaction():`` is bound to the task that opened it (nested blocks in that
task join it; other tasks, its own child tasks included, wait for it as other threads wait
for a sync transaction). On SQLite the block gets a thread of its own for its life, so a
transaction never needs a pool thread that a call waiting for the writer is occupying.

Cancellation ("landed whole"): a call cancelled before it started never runs; a call that had
started runs to its end (its write lands whole, or fails whole) and then ``CancelledError`` is
raised. No transaction stays open and no lock stays held: a cancelled ``transaction()`` block
is rolled back, a cancelled commit finishes first. A write whose call returned is committed.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import itertools
import logging
import queue
import sys
import threading
from collections.abc import (
    AsyncIterator,
    Callable,
    Coroutine,
    Iterator,
)
from concurrent.futures import Future as ThreadFuture
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Concatenate, Generic, ParamSpec, TypeVar, overload

import sqlalchemy as sa
from sqlalchemy.engine import Engine, make_url

from hermes_store import validate
from hermes_store.engine.factory import Target, default_db_path, display_url, to_url
from hermes_store.errors import (
    InvalidInputError,
    StoreMisuseError,
    TransactionMisuseError,
    extras_named,
)
from hermes_store.store import SessionDB
from hermes_store.uow.unit import CALLING_TASK, Unit

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine


log = logging.getLogger(__name__)

T = TypeVar("T")

#: Threads per SQLite store: enough to keep reads flowing while one waits for the writer.
DEFAULT_THREADS = 8
#: How often an open SQLite transaction()'s thread looks whether its event loop was closed.
LOOP_WATCH_S = 0.5
#: A task's call waiting this long for another task's transaction() block to end is logged.
BLOCK_WAIT_NOTICE_S = 10.0


@dataclass
class CancelStats:
    """What cancellations met: calls dropped before they started, and started calls that
    ran to their end (succeeded: their write landed whole) before ``CancelledError``."""

    not_started: int = 0
    finished: int = 0
    finished_ok: int = 0


def _is_async_engine(target: object) -> bool:
    ext = sys.modules.get("sqlalchemy.ext.asyncio")
    return ext is not None and isinstance(target, ext.AsyncEngine)


def _uses_threads(target: object) -> bool:
    """SQLite (a path, a SQLite URL or any sync Engine) runs on threads; a PostgreSQL URL or
    an AsyncEngine natively async. Decided without I/O."""
    if _is_async_engine(target):
        return False
    if target is None or isinstance(target, Engine):
        return True
    if isinstance(target, sa.URL):
        return target.get_backend_name() == "sqlite"
    if isinstance(target, str) and "://" in target:
        return make_url(target).get_backend_name() == "sqlite"
    return True


async def _finish(future: asyncio.Future[Any]) -> tuple[Any, BaseException | None, bool]:
    """Wait for ``future`` to complete whatever happens to the waiting task: its (result,
    error) and whether the waiting task was cancelled meanwhile."""
    cancelled = False
    while True:
        try:
            result = await asyncio.shield(future)
        except asyncio.CancelledError:
            if not future.done():
                cancelled = True
                continue
            if future.cancelled():
                return None, asyncio.CancelledError(), cancelled
            return None, future.exception(), cancelled
        except BaseException as error:
            return None, error, cancelled
        return result, None, cancelled


class _TxThread:
    """The thread of one open SQLite ``transaction()``: runs the block's calls in order and,
    between them, watches the block's event loop. A loop closed with the block still open
    (``run_until_complete`` then ``close()``, its task never cancelled) can never resume the
    block, so the thread rolls it back (``abandon``) and ends: SQLite's write lock is never
    stranded."""

    def __init__(self, loop: asyncio.AbstractEventLoop, abandon: Callable[[], None]) -> None:
        self._loop = loop
        self._abandon = abandon
        self._calls: queue.SimpleQueue[tuple[ThreadFuture[Any], Callable[[], Any]] | None] = (
            queue.SimpleQueue()
        )
        # A daemon: at interpreter exit nothing waits for a block nobody can end.
        self._thread = threading.Thread(target=self._serve, name="hermes-aio-tx", daemon=True)
        self._thread.start()

    def submit(self, call: Callable[[], T]) -> ThreadFuture[T]:
        done: ThreadFuture[T] = ThreadFuture()
        self._calls.put((done, call))
        return done

    def shutdown(self, wait: bool = False) -> None:
        self._calls.put(None)
        if wait:
            self._thread.join()

    def _serve(self) -> None:
        while True:
            try:
                item = self._calls.get(timeout=LOOP_WATCH_S)
            except queue.Empty:
                if self._loop.is_closed():
                    self._abandon()
                    return
                continue
            if item is None:
                return
            done, call = item
            if not done.set_running_or_notify_cancel():
                continue
            try:
                result = call()
            except BaseException as error:
                done.set_exception(error)
            else:
                done.set_result(result)


class _Tx:
    """One open ``transaction()``: the task it belongs to and where its calls run."""

    def __init__(self, owner: AsyncSessionDB, task: asyncio.Task[Any] | None) -> None:
        self.owner = owner
        self.task = task
        #: The outermost block's context manager and unit once it has begun (ended once).
        self.cm: AbstractContextManager[Any] | None = None
        self.unit: Unit | None = None
        self.ended = False
        self.loop = asyncio.get_running_loop()
        # SQLite: a thread of its own for the block's life (the unit lives in its context);
        # PostgreSQL: a context of its own that every call of the block runs in.
        self.thread = _TxThread(self.loop, self._abandon) if owner._threads else None
        self.context = contextvars.Context()
        #: Set once the block is over: tasks started inside it wait for this (see
        #: :meth:`AsyncSessionDB._behind_a_block`).
        self.over = asyncio.Event()

    def end(self, error: BaseException | None) -> Callable[[], object]:
        """The call (run where the block's calls run) that ends the block: commit, or roll
        back on ``error``; only the first one counts."""

        def call() -> object:
            cm = self.cm
            if cm is None or self.ended:
                return None
            self.ended = True
            if error is None:
                return cm.__exit__(None, None, None)
            return cm.__exit__(type(error), error, error.__traceback__)

        return call

    def _abandon(self) -> None:
        """On the block's thread, its event loop closed: roll the block back."""
        if self.cm is None or self.ended:
            return
        error = TransactionMisuseError(_ABANDONED)
        log.warning("%s", error)
        try:
            self.end(error)()
        except TransactionMisuseError:
            pass  # the block's own exit re-raises the error it was ended with
        except Exception:
            log.exception("rolling back a transaction() block whose event loop was closed")

    def sever(self) -> None:
        """PostgreSQL, the block can no longer be ended through its loop (closed, or the task
        destroyed): close its server connection, so the server rolls the transaction back
        and releases its row locks. Nothing is awaited: libpq closes the socket itself."""
        unit, cm = self.unit, self.cm
        if unit is None or cm is None or self.ended:
            return
        self.ended = True
        log.warning("%s", _ABANDONED.replace("rolled back", "rolled back by the server"))
        try:
            driver: Any = unit.conn.connection.driver_connection
            driver.pgconn.finish()
        except Exception:
            log.exception("closing the connection of an abandoned transaction() block")
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # no loop here (the watcher): end the block's generators too,
            # so the garbage collector never runs their rollback where it cannot await
            exit_call = _exit_call(cm, TransactionMisuseError(_ABANDONED))
            try:
                asyncio.run(_in_greenlet(exit_call))
            except Exception as error:  # expected: its connection is closed
                log.info("ending an abandoned transaction() block: %s", error)

    def submit(self, call: Callable[[], T]) -> tuple[asyncio.Future[T], Callable[[], bool]]:
        if self.thread is not None:
            return _on_thread(self.thread, call)
        context, called = self.context, _as_caller(call)
        return _on_greenlet(lambda: context.run(called))

    async def run(self, call: Callable[[], T]) -> T:
        return await self.owner._settle(*self.submit(call))


_ABANDONED = (
    "the event loop of an open async with adb.transaction() block was closed (or its task "
    "destroyed) without cancelling its task: the block was rolled back (cancel pending tasks, "
    "or use asyncio.run(), before closing a loop)"
)
_watch_lock = threading.Lock()
_watched: set[_Tx] = set()
_watcher: threading.Thread | None = None


def _watch(tx: _Tx) -> None:
    """Watch a PostgreSQL block's loop (a SQLite block's own thread watches its loop)."""
    global _watcher
    with _watch_lock:
        _watched.add(tx)
        if _watcher is None:
            _watcher = threading.Thread(target=_watch_loops, name="hermes-aio-watch", daemon=True)
            _watcher.start()


def _unwatch(tx: _Tx) -> None:
    with _watch_lock:
        _watched.discard(tx)


def _watch_loops() -> None:
    """While PostgreSQL blocks are open: sever those whose event loop was closed."""
    global _watcher
    pause = threading.Event()
    while True:
        pause.wait(LOOP_WATCH_S)
        with _watch_lock:
            if not _watched:
                _watcher = None
                return
            closed = [tx for tx in _watched if tx.loop.is_closed()]
            _watched.difference_update(closed)
        for tx in closed:
            tx.sever()


P = ParamSpec("P")
R = TypeVar("R")
Y = TypeVar("Y")


class _Name:
    """A name in generated source: a default shown by name in the twin's header."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


def _passed(param: inspect.Parameter) -> str:
    """How a twin hands ``param`` on: as it was given (positional or by keyword)."""
    if param.kind is param.VAR_POSITIONAL:
        return f"*{param.name}"
    if param.kind is param.KEYWORD_ONLY:
        return f"{param.name}={param.name}"
    if param.kind is param.VAR_KEYWORD:
        return f"**{param.name}"
    return param.name


class _Twin:
    """The declaration, in ``AsyncSessionDB``'s body, of the async twin of a ``SessionDB``
    method: one line per method, everything else derived from the method itself.

    When the class is created (``__set_name__``) the declaration puts in its place a real
    ``async def`` compiled from the method's own signature, as :mod:`dataclasses` compiles an
    ``__init__``: the same parameters, kinds, defaults and docstring, so a wrong call fails
    when it is made (as a hand-written coroutine's would), ``inspect`` sees a coroutine (or
    async generator) function with SessionDB's signature, and calling it costs what a
    hand-written forwarder costs. Type checkers see the subclasses' ``__get__`` instead: the
    sync method's parameters (a ``ParamSpec``) returning an awaitable or an async iterator.
    """

    #: The twin's body: ``{self}`` is its first parameter, ``{args}`` the method's arguments
    #: after the store (each with a leading comma), ``{batch}`` the stream's page parameter.
    template: tuple[str, ...]

    def __init__(self, method: Callable[..., Any], batch: str | None = None) -> None:
        self.method = method
        self.signature = inspect.signature(method)
        self.batch = batch
        if batch is not None and batch not in self.signature.parameters:
            raise TypeError(f"SessionDB.{method.__name__} has no parameter {batch!r}")

    def __set_name__(self, owner: type[Any], name: str) -> None:
        if name != self.method.__name__:
            raise TypeError(
                f"{owner.__name__}.{name} is declared from SessionDB.{self.method.__name__}"
            )
        setattr(owner, name, self.build(owner))

    def build(self, owner: type[Any]) -> Callable[..., Any]:
        """The twin: an ``async def`` with the method's signature that forwards every argument
        as it was given (positional stays positional, keyword stays keyword)."""
        name = self.method.__name__
        first, *rest = self.signature.parameters.values()
        namespace: dict[str, Any] = {"_method": self.method, "_integer": validate.integer}
        shown = [first.replace(annotation=first.empty)]
        args = ""
        for param in rest:
            if param.name.startswith("_"):
                raise TypeError(f"SessionDB.{name}: {param.name!r} would shadow the twin's names")
            default: Any = param.empty
            if param.default is not param.empty:
                namespace[f"_default_{param.name}"] = param.default
                default = _Name(f"_default_{param.name}")
            shown.append(param.replace(annotation=param.empty, default=default))
            args += ", " + _passed(param)
        header = self.signature.replace(parameters=shown, return_annotation=first.empty)
        body = "\n    ".join(self.template).format(self=first.name, args=args, batch=self.batch)
        exec(f"async def {name}{header}:\n    {body}\n", namespace)
        twin: Callable[..., Any] = namespace[name]
        twin.__module__ = owner.__module__
        twin.__qualname__ = f"{owner.__qualname__}.{name}"
        twin.__doc__ = self.method.__doc__
        annotations = dict(self.method.__annotations__)
        returned = annotations.get("return")
        if self.batch is not None and isinstance(returned, str) and returned.startswith("Iter"):
            annotations["return"] = f"Async{returned}"  # Iterator[X] -> AsyncIterator[X]
        twin.__annotations__ = annotations
        return twin

    def bound(self, obj: Any, owner: type[Any]) -> Any:
        """Outside a class body (no ``__set_name__``): the twin, built on demand."""
        return self.build(owner).__get__(obj, owner)


class _Coroutine(_Twin, Generic[P, R]):
    template = ("return await {self}._call(_method{args})",)

    def __init__(self, method: Callable[Concatenate[SessionDB, P], R]) -> None:
        super().__init__(method)

    @overload
    def __get__(
        self, obj: None, owner: type[Any]
    ) -> Callable[Concatenate[AsyncSessionDB, P], Coroutine[Any, Any, R]]: ...

    @overload
    def __get__(
        self, obj: AsyncSessionDB, owner: type[Any]
    ) -> Callable[P, Coroutine[Any, Any, R]]: ...

    def __get__(self, obj: AsyncSessionDB | None, owner: type[Any]) -> Any:
        return self.bound(obj, owner)


class _Stream(_Twin, Generic[P, Y]):
    #: As the sync generator validates its page size, but before the first hop: a page of
    #: 0 would never end the stream.
    template = (
        "_integer({batch!r}, {batch}, minimum=1)",
        "async for _item in {self}._stream(lambda _db: _method(_db{args}), {batch}):",
        "    yield _item",
    )

    def __init__(
        self, method: Callable[Concatenate[SessionDB, P], Iterator[Y]], batch: str
    ) -> None:
        super().__init__(method, batch)

    @overload
    def __get__(
        self, obj: None, owner: type[Any]
    ) -> Callable[Concatenate[AsyncSessionDB, P], AsyncIterator[Y]]: ...

    @overload
    def __get__(self, obj: AsyncSessionDB, owner: type[Any]) -> Callable[P, AsyncIterator[Y]]: ...

    def __get__(self, obj: AsyncSessionDB | None, owner: type[Any]) -> Any:
        return self.bound(obj, owner)


def _coroutine_of(method: Callable[Concatenate[SessionDB, P], R]) -> _Coroutine[P, R]:
    """``SessionDB.method`` as a coroutine of ``AsyncSessionDB`` (run off the loop)."""
    return _Coroutine(method)


def _stream_of(
    method: Callable[Concatenate[SessionDB, P], Iterator[Y]], *, batch: str
) -> _Stream[P, Y]:
    """A ``SessionDB`` generator as an async iterator: ``batch`` names the parameter that
    says how many items each hop off the loop brings."""
    return _Stream(method, batch)


class AsyncSessionDB:
    """:class:`~hermes_store.SessionDB` for asyncio: the same constructor arguments and every
    public method as a coroutine with the same signature and return value.

    ``db_path`` is what ``SessionDB`` takes (a path, a URL, an Engine) or a SQLAlchemy
    ``AsyncEngine``; constructing does no I/O: opening (adoption and migration included) runs
    off the loop on ``async with`` or the first call. ``max_threads`` bounds the threads of a
    SQLite store; every other keyword goes to ``SessionDB`` as it is.
    """

    MAX_TITLE_LENGTH = SessionDB.MAX_TITLE_LENGTH
    #: Pure text work, no I/O: the same static method as ``SessionDB.sanitize_title``.
    sanitize_title = staticmethod(SessionDB.sanitize_title)

    def __init__(
        self,
        db_path: Target | AsyncEngine | None = None,
        *,
        max_threads: int = DEFAULT_THREADS,
        **options: Any,
    ) -> None:
        max_threads = validate.integer("max_threads", max_threads, minimum=1)
        if not _is_async_engine(db_path):
            validate.target(db_path)
        self._target = db_path
        self._options = options
        self._max_threads = max_threads
        self._threads = _uses_threads(db_path)
        self._sync: SessionDB | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._engine: AsyncEngine | None = None
        self._owns_engine = False
        self._opening = asyncio.Lock()
        self._tx: contextvars.ContextVar[_Tx | None] = contextvars.ContextVar(
            f"hermes_async_tx_{id(self)}", default=None
        )
        self._closed = False
        self.cancellations = CancelStats()

    def __reduce__(self) -> Any:
        """Refused: a store is connections, threads and an event loop's state of this
        process; another process opens its own."""
        raise StoreMisuseError(
            "an AsyncSessionDB cannot be pickled (or passed to another process, e.g. as a "
            "multiprocessing.Pool argument): pass its path or URL and open a store in the "
            "other process"
        )

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> AsyncSessionDB:
        """The same store on any SQLAlchemy URL (no I/O until first use)."""
        validate.text("url", url)
        return cls(url, **kwargs)

    # -- lifecycle --------------------------------------------------------------------------

    async def __aenter__(self) -> AsyncSessionDB:
        await self._open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def sync(self) -> SessionDB:
        """The ``SessionDB`` underneath (opened); for code that runs off the loop, as in
        :meth:`run_sync` (on PostgreSQL its methods work only there: elsewhere they raise
        :class:`~hermes_store.errors.StoreMisuseError`)."""
        if self._sync is None:
            raise StoreMisuseError("the store is not open yet: await a call or use async with")
        return self._sync

    async def _open(self) -> SessionDB:
        if self._closed:
            raise StoreMisuseError("this AsyncSessionDB is closed")
        if self._sync is not None:
            return self._sync
        async with self._opening:
            if self._closed:
                raise StoreMisuseError("this AsyncSessionDB is closed")
            if self._sync is None:
                if self._threads:
                    self._pool = ThreadPoolExecutor(self._max_threads, "hermes-aio")
                    target = default_db_path() if self._target is None else self._target
                    opening = partial(SessionDB, target, **self._options)  # type: ignore[arg-type]
                    self._sync = await self._settle(*_on_thread(self._pool, opening))
                else:
                    with extras_named():
                        engine = self._async_engine()
                    try:
                        opening = partial(SessionDB, engine.sync_engine, **self._options)
                        with extras_named():
                            settling = _on_greenlet(opening)
                        self._sync = await self._settle(*settling)
                    except BaseException:
                        if self._owns_engine:
                            await engine.dispose()
                        raise
        return self._sync

    def _async_engine(self) -> AsyncEngine:
        from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

        from hermes_store.engine.factory import (
            install_liveness_check,
            install_pooler_guard,
            install_read_only_names,
            psycopg_options,
            register_origin,
        )

        if isinstance(self._target, AsyncEngine):
            install_pooler_guard(self._target.sync_engine)
            self._engine = self._target
            return self._target
        url = to_url(self._target)  # type: ignore[arg-type]
        if url.get_backend_name() != "postgresql":
            raise InvalidInputError(
                f"AsyncSessionDB serves SQLite or PostgreSQL, not {display_url(url)}"
            )
        url = url.set(drivername="postgresql+psycopg_async")
        url, kwargs = psycopg_options(url, {})
        # As the sync store's engine: a modest pool, no ping per call (the liveness check
        # pings only connections idle for a while), the twin made from the same arguments.
        kwargs.update(pool_size=5, max_overflow=10)
        self._engine = create_async_engine(url, **kwargs)
        sync_engine = self._engine.sync_engine
        install_liveness_check(sync_engine)
        install_pooler_guard(sync_engine)
        # A transaction block's write refused by a standby says so, as SessionDB's do.
        install_read_only_names(sync_engine)
        register_origin(sync_engine, url, kwargs.get("connect_args", {}))
        self._owns_engine = True
        return self._engine

    async def close(self) -> None:
        """Close the store (the sync ``close`` off the loop) and its threads or engine; safe
        to call twice."""
        if self._closed:
            return
        tx = self._tx.get()
        if tx is not None and tx.task is asyncio.current_task():
            raise StoreMisuseError("close() inside an open transaction(): leave the block first")
        self._refuse_held_writer()
        async with self._opening:
            self._closed = True
        if self._sync is not None:
            await self._must(self._submit(self._sync.close))
        if self._pool is not None:
            self._pool.shutdown(wait=False)
        if self._engine is not None and self._owns_engine:
            await self._engine.dispose()

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[None]:
        """One unit for every call of this task inside the block: commit at the end, rollback
        of everything on an exception (cancellation included). A nested block is a SAVEPOINT
        in it: an exception leaving the nested block rolls back its writes only. Other tasks'
        calls wait for it and land after it, as other threads' do in ``SessionDB``."""
        db = await self._open()
        self._refuse_held_writer()
        task = asyncio.current_task()
        open_tx = self._tx.get()
        nested = open_tx is not None and open_tx.task is task
        if not nested:
            await self._behind_a_block()
        tx = open_tx if open_tx is not None and nested else _Tx(self, task)
        token = None if nested else self._tx.set(tx)
        body_thread = threading.get_ident()  # the loop's: it must never wait for this writer
        try:
            cm = db.transaction()
            entered: list[bool] = []

            def begin() -> None:
                cm.__enter__()
                try:
                    if not nested:
                        # A store closed while this block waited for the writer raises here
                        # (its uow is gone): the unit just begun is ended at once, never
                        # left holding the writer (SQLite's lock) for good.
                        unit = db.uow.current()
                        if unit is not None:
                            unit.body_thread = body_thread
                        tx.unit, tx.cm = unit, cm
                except BaseException as error:
                    cm.__exit__(type(error), error, error.__traceback__)
                    raise
                entered.append(True)

            def ending(error: BaseException | None) -> Callable[[], object]:
                return _exit_call(cm, error) if nested else tx.end(error)

            async def end(error: BaseException | None) -> None:
                if nested and tx.over.is_set():
                    # The outer block ended first (out of order): its unit is over and its
                    # thread gone. Ending this block touches no connection (it raises
                    # TransactionMisuseError, or lets its own error go on): it runs here.
                    ending(error)()
                    return
                await self._must(tx.submit(ending(error)))

            try:
                await tx.run(begin)
            except asyncio.CancelledError as cancelled:
                if entered:  # begun all the same (the call had started): roll it back
                    await self._must(tx.submit(ending(cancelled)))
                raise
            if not nested and tx.thread is None:
                _watch(tx)
            try:
                yield
            except GeneratorExit as closed:
                # The task was destroyed unfinished (its loop closed, or it was dropped):
                # nothing can be awaited now, so the block ends on its own thread unawaited.
                if tx.thread is not None:
                    tx.thread.submit(ending(closed))
                elif not nested:
                    tx.sever()
                raise
            except BaseException as error:
                await end(error)
                raise
            await end(None)
        finally:
            if not nested:
                tx.over.set()
            if token is not None and self._tx.get() is tx:
                self._tx.reset(token)
            if not nested and tx.thread is not None:
                tx.thread.shutdown(wait=False)
            elif not nested:
                _unwatch(tx)

    def _refuse_held_writer(self) -> None:
        """SQLite: a call from inside a sync write block of this thread on the same file
        would wait for the writer that block holds, and the block cannot end before the call
        returns: refused at once."""
        db = self._sync
        if db is None or not self._threads:
            return
        unit = db.uow.current()
        if unit is not None and unit.write:
            raise TransactionMisuseError(
                "an AsyncSessionDB call inside a sync db.transaction() (or uow.connect(), "
                "uow.session()) block on the same file: it would wait forever for the writer "
                "that block holds. Make the call after the block, or use async with "
                "adb.transaction() and await the calls inside it"
            )

    # -- running calls off the loop ----------------------------------------------------------

    def _submit(self, call: Callable[[], T]) -> tuple[asyncio.Future[T], Callable[[], bool]]:
        """Start ``call`` off the loop where this task's calls run: its future and a function
        that cancels it if it has not started (True: it never will)."""
        self._refuse_held_writer()
        tx = self._tx.get()
        if tx is not None and tx.task is asyncio.current_task():
            return tx.submit(call)
        if self._threads:
            assert self._pool is not None
            return _on_thread(self._pool, call)
        return _on_greenlet(call)

    async def _settle(self, future: asyncio.Future[T], cancel_pending: Callable[[], bool]) -> T:
        """The call's result; cancelled meanwhile, it is dropped if not started, else waited
        for (it lands whole or fails whole) before ``CancelledError`` goes on."""
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            if not future.done() and cancel_pending():
                self.cancellations.not_started += 1
                raise
            _, error, _ = await _finish(future)
            self.cancellations.finished += 1
            if error is None:
                self.cancellations.finished_ok += 1
            raise

    async def _must(self, submitted: tuple[asyncio.Future[T], Callable[[], bool]]) -> T:
        """Run a call that must not be abandoned (commit, rollback, closing a stream) to its
        end, then pass on its error or a cancellation that came meanwhile."""
        result, error, cancelled = await _finish(submitted[0])
        if error is not None:
            raise error
        if cancelled:
            raise asyncio.CancelledError()
        return result  # type: ignore[no-any-return]

    async def _run(self, call: Callable[[], T]) -> T:
        await self._behind_a_block()
        return await self._settle(*self._submit(call))

    async def _behind_a_block(self) -> None:
        """A task started inside another task's open ``transaction()`` block sees that block
        (tasks copy their context) and its calls land after it: they wait here, on the loop,
        for the block to end. Waiting in a thread for the block's writer (or, on PostgreSQL,
        its row locks) instead, a call could not be cancelled, and a block that awaited such
        a task (``gather``, ``wait_for``) hung for good, its timeout never firing."""
        tx = self._tx.get()
        if tx is None or tx.task is asyncio.current_task() or tx.over.is_set():
            return
        if tx.loop is not asyncio.get_running_loop():
            return  # a copied context on another loop: its event is not this loop's
        try:
            await asyncio.wait_for(tx.over.wait(), BLOCK_WAIT_NOTICE_S)
        except TimeoutError:
            log.warning(
                "a call of a task started inside a transaction() block waits for that block "
                "to end (%.0f s so far); if the block awaits this task, neither ends: await "
                "such calls in the block's own task, or start the task after the block",
                BLOCK_WAIT_NOTICE_S,
            )
            await tx.over.wait()

    async def _call(self, method: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        db = await self._open()
        return await self._run(partial(method, db, *args, **kwargs))

    async def run_sync(self, fn: Callable[[SessionDB], T]) -> T:
        """``fn(sync_store)`` off the loop (in this task's transaction if one is open): the
        escape hatch for code written against ``SessionDB`` (``uow.session()``, ORM queries).
        On PostgreSQL it runs in SQLAlchemy's greenlet: only database I/O may block in it."""
        db = await self._open()
        return await self._run(partial(fn, db))

    async def _stream(
        self, make: Callable[[SessionDB], Iterator[T]], batch: int
    ) -> AsyncIterator[T]:
        """Drive a ``SessionDB`` generator off the loop, ``batch`` items per hop."""
        db = await self._open()
        iterator = make(db)
        close = getattr(iterator, "close", None)
        try:
            while True:
                chunk = await self._run(partial(_take, iterator, batch))
                for item in chunk:
                    yield item
                if len(chunk) < batch:
                    return
        finally:
            if close is not None:
                await self._must(self._submit(close))

    # -- every other public SessionDB method, derived from its signature --------------------
    # One line per method; the parameters, defaults and docstring are SessionDB's own (see
    # ``_Twin``), so a parameter is never forgotten, and a method forgotten here fails the
    # signature-parity test.

    stats = _coroutine_of(SessionDB.stats)
    create_session = _coroutine_of(SessionDB.create_session)
    ensure_session = _coroutine_of(SessionDB.ensure_session)
    end_session = _coroutine_of(SessionDB.end_session)
    reopen_session = _coroutine_of(SessionDB.reopen_session)
    update_system_prompt = _coroutine_of(SessionDB.update_system_prompt)
    get_session = _coroutine_of(SessionDB.get_session)
    resolve_session_id = _coroutine_of(SessionDB.resolve_session_id)
    unique_id_prefixes = _coroutine_of(SessionDB.unique_id_prefixes)
    get_child_sessions = _coroutine_of(SessionDB.get_child_sessions)
    count_sessions = _coroutine_of(SessionDB.count_sessions)
    delete_session = _coroutine_of(SessionDB.delete_session)
    prune_sessions = _coroutine_of(SessionDB.prune_sessions)
    get_compression_tip = _coroutine_of(SessionDB.get_compression_tip)
    set_session_title = _coroutine_of(SessionDB.set_session_title)
    get_session_title = _coroutine_of(SessionDB.get_session_title)
    get_session_by_title = _coroutine_of(SessionDB.get_session_by_title)
    resolve_session_by_title = _coroutine_of(SessionDB.resolve_session_by_title)
    get_next_title_in_lineage = _coroutine_of(SessionDB.get_next_title_in_lineage)
    update_token_counts = _coroutine_of(SessionDB.update_token_counts)
    append_message = _coroutine_of(SessionDB.append_message)
    append_messages = _coroutine_of(SessionDB.append_messages)
    get_messages = _coroutine_of(SessionDB.get_messages)
    iter_messages = _stream_of(SessionDB.iter_messages, batch="page_size")
    get_messages_as_conversation = _coroutine_of(SessionDB.get_messages_as_conversation)
    clear_messages = _coroutine_of(SessionDB.clear_messages)
    message_count = _coroutine_of(SessionDB.message_count)
    session_count = _coroutine_of(SessionDB.session_count)
    search_sessions = _coroutine_of(SessionDB.search_sessions)
    list_sessions_rich = _coroutine_of(SessionDB.list_sessions_rich)
    search_messages = _coroutine_of(SessionDB.search_messages)
    rebuild_search_index = _coroutine_of(SessionDB.rebuild_search_index)
    optimize_search_index = _coroutine_of(SessionDB.optimize_search_index)
    check_search_index = _coroutine_of(SessionDB.check_search_index)
    # mypy refuses a method whose **options could also take a keyword named "self"; the
    # twin's type it derives is still the method's own.
    backup = _coroutine_of(SessionDB.backup)  # type: ignore[arg-type]
    export_session = _coroutine_of(SessionDB.export_session)
    export_all = _coroutine_of(SessionDB.export_all)
    iter_export = _stream_of(SessionDB.iter_export, batch="page_size")


def _take(iterator: Iterator[T], count: int) -> list[T]:
    return list(itertools.islice(iterator, count))


def _exit_call(
    cm: AbstractContextManager[Any], error: BaseException | None
) -> Callable[[], object]:
    """The call that leaves ``cm`` (with ``error``, if any)."""
    if error is None:
        return partial(cm.__exit__, None, None, None)
    return partial(cm.__exit__, type(error), error, error.__traceback__)


async def _in_greenlet(call: Callable[[], T]) -> T:
    from sqlalchemy.util.concurrency import greenlet_spawn

    return await greenlet_spawn(call)


def _on_thread(
    pool: ThreadPoolExecutor | _TxThread, call: Callable[[], T]
) -> tuple[asyncio.Future[T], Callable[[], bool]]:
    done: ThreadFuture[T] = pool.submit(call)
    # Never cancelled through the asyncio wrapper (always awaited shielded): a call that
    # started is never abandoned; ``done.cancel`` only succeeds before it starts.
    return asyncio.wrap_future(done), done.cancel


def _as_caller(call: Callable[[], T]) -> Callable[[], T]:
    """``call``, told the task it was made in (:data:`CALLING_TASK`) wherever it runs: the
    store refuses a write that task's own open block would keep waiting."""
    caller = asyncio.current_task()

    def called() -> T:
        token = CALLING_TASK.set(caller)
        try:
            return call()
        finally:
            CALLING_TASK.reset(token)

    return called


def _on_greenlet(call: Callable[[], T]) -> tuple[asyncio.Future[T], Callable[[], bool]]:
    from sqlalchemy.util.concurrency import greenlet_spawn

    call = _as_caller(call)
    started = False

    async def body() -> T:
        nonlocal started
        started = True
        return await greenlet_spawn(call)

    # A task of its own (its own copy of the context): cancelling the caller never throws
    # into a driver round trip; cancelled before its first step, ``body`` never runs.
    task = asyncio.ensure_future(body())
    return task, lambda: not started and task.cancel()
