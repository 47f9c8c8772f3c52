"""What stays sound when Ctrl-C lands anywhere: locks taken where an interrupt cannot be lost,
context managers their caller can let go of, bookkeeping run to its end.

CPython raises a signal's exception (``KeyboardInterrupt``) in the main thread where it checks
for pending signals: as a function starts or a generator resumes, as a C function returns, at
a loop's backward jump. So ``if lock.acquire(blocking=False):`` can take the lock and raise
before the ``try`` that releases it; a context manager's Python ``__enter__`` can return its
resource and raise before the ``with`` holds it, and its ``__exit__`` can raise before its
first line. Only a C lock's own ``with`` (``with lock:``) is safe by itself. The package
assumes one interrupt at a time (a second Ctrl-C while the first one's cleanup runs is not
covered): the cleanup a handler runs for the interrupt it caught always completes.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator
from contextlib import AbstractContextManager, nullcontext
from functools import wraps
from itertools import compress
from operator import methodcaller
from types import TracebackType
from typing import Any, Generic, ParamSpec, TypeVar

T = TypeVar("T")
P = ParamSpec("P")

_TRY_ONCE = methodcaller("acquire", False)


def acquire_now(lock: Any, held: list[Any]) -> bool:
    """``lock.acquire(blocking=False)``, the lock appended to ``held`` when taken, in one C
    call chain: no point between the two where an interrupt could leave it taken and unknown.
    The caller releases what ``held`` holds in its ``finally``."""
    before = len(held)
    held.extend(compress((lock,), map(_TRY_ONCE, (lock,))))
    return len(held) > before


def acquire_within(lock: Any, timeout: float, held: list[Any]) -> bool:
    """:func:`acquire_now` waiting up to ``timeout`` seconds (an interrupt while it waits
    leaves the lock untaken)."""
    before = len(held)
    held.extend(compress((lock,), map(methodcaller("acquire", True, timeout), (lock,))))
    return len(held) > before


def uninterrupted(step: Callable[[], None]) -> None:
    """Run ``step`` (idempotent bookkeeping) to its end, again if an interrupt (Ctrl-C)
    cut it short: the interrupt being raised already is the one its caller gets."""
    while True:
        try:
            step()
            return
        except Exception:
            raise
        except BaseException:
            continue


class Holding(AbstractContextManager[T], Generic[T]):
    """The context manager of a one-``yield`` generator (as ``contextlib.contextmanager``
    makes), which its caller can also let go of from outside the ``with``: :meth:`release`
    closes the generator, running its ``finally`` blocks, once. For generators that hold a
    lock or a place in a line across their ``yield``: an interrupt raised as ``__enter__``
    returns, or as ``__exit__`` starts, leaves the generator suspended, holding it until the
    interrupt's traceback is freed (a REPL keeps the last one), so a caller that catches it
    calls :meth:`release`."""

    __slots__ = ("_generator",)

    def __init__(self, generator: Generator[T, None, None]) -> None:
        self._generator = generator

    def __enter__(self) -> T:
        try:
            return next(self._generator)
        except StopIteration:
            raise RuntimeError("the generator did not yield") from None

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool:
        generator = self._generator
        if error is None:
            try:
                next(generator)
            except StopIteration:
                return False
            raise RuntimeError("the generator did not stop")
        try:
            generator.throw(error)
        except StopIteration as stop:
            return stop is not error
        except RuntimeError as raised:  # a StopIteration thrown in comes back as one
            if raised is error or (isinstance(error, StopIteration) and raised.__cause__ is error):
                error.__traceback__ = traceback
                return False
            raise
        except BaseException as raised:
            if raised is error:
                raised.__traceback__ = traceback
                return False
            raise
        raise RuntimeError("the generator did not stop after throw()")

    def release(self) -> None:
        """Let go of what the generator holds (its ``finally`` blocks run), if it still
        holds anything: a no-op once the ``with`` ended it, or before it began."""
        uninterrupted(self._generator.close)


def holding(
    function: Callable[P, Iterator[T]],
) -> Callable[P, Holding[T]]:
    """Decorate a one-``yield`` generator function as :class:`Holding` context managers."""

    @wraps(function)
    def make(*args: P.args, **kwargs: P.kwargs) -> Holding[T]:
        return Holding(function(*args, **kwargs))  # type: ignore[arg-type]

    return make


class NothingHeld(nullcontext[None]):
    """A turn that holds nothing (PostgreSQL's, a read's): :meth:`release` has nothing to do."""

    def release(self) -> None:
        """Nothing to let go of."""


NOTHING_HELD = NothingHeld()
