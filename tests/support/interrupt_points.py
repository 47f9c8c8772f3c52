"""Ctrl-C at every point where CPython can raise it, one point per run, without signals.

A signal's exception (``KeyboardInterrupt``) is raised in the main thread only where CPython
3.11 checks its "eval breaker": as a function starts or a generator resumes after a ``yield``,
as a C function returns (a lock's ``acquire``, a driver's ``execute``, ``next()``), and at a
loop's backward jump. A real SIGINT lands on one of these at random; :class:`InterruptAt`
raises at the ``n``-th of them in the watched code, so a test can walk ``n`` over every point
of an operation and check, after each, that nothing stayed held (a lock, a transaction, a
place in a line). The windows of the caller's own ``with`` statement (a context manager's
``__enter__`` or ``__exit__`` called from the test's code) are left out: only the caller can
close them.

How: a trace function (``sys.settrace``, opcode events) and a profile function
(``sys.setprofile``, ``c_return`` events). An exception raised from a trace function at an
instruction's opcode event is raised at that instruction, so the point "a C call returned"
is the next instruction of the calling frame; it counts only when the exception table gives
that instruction the same handler as the call's (the code right after ``return f()`` inside
a ``with`` is the ``with``'s exit, outside its block, where the real check, inside the call,
is not).
"""

from __future__ import annotations

import dis
import sys
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Any

#: Where the points are counted: the package and the standard library's locks and context
#: managers it uses (a point in SQLAlchemy's or sqlite3's own code is the same point, for
#: the package, as the C call of the package's that reached it).
WATCHED = ("/hermes_store/", "/contextlib.py", "/threading.py")

_JUMP_BACK = frozenset({"JUMP_BACKWARD", "JUMP_BACKWARD_NO_INTERRUPT"})
#: A context manager's methods: called by code outside the watched files, they belong to the
#: caller's own ``with`` (an interrupt as ``__enter__`` returns or ``__exit__`` starts is
#: between the caller's statements, which the package cannot see: not counted).
_WITH_METHODS = frozenset({"__enter__", "__exit__"})

_handlers: dict[CodeType, Callable[[int], int | None]] = {}
_jumps: dict[CodeType, frozenset[int]] = {}


def _handler_of(code: CodeType) -> Callable[[int], int | None]:
    """The exception handler's offset (None: none) for each instruction offset of ``code``."""
    found = _handlers.get(code)
    if found is None:
        entries = dis._parse_exception_table(code)  # type: ignore[attr-defined]

        def found(offset: int) -> int | None:
            for entry in entries:
                if entry.start <= offset < entry.end:
                    return int(entry.target)
            return None

        _handlers[code] = found
    return found


def _backward_jumps(code: CodeType) -> frozenset[int]:
    found = _jumps.get(code)
    if found is None:
        found = _jumps[code] = frozenset(
            i.offset for i in dis.get_instructions(code) if i.opname in _JUMP_BACK
        )
    return found


class InterruptAt:
    """Raise ``KeyboardInterrupt`` at the ``n``-th interrupt point (1-based) met in watched
    code while installed (``with InterruptAt(n) as points:``); :attr:`count` says how many
    points were met, :attr:`where` where it raised (None: the operation had fewer)."""

    def __init__(self, n: int, watched: tuple[str, ...] = WATCHED) -> None:
        self.n = n
        self._watched = watched
        self.count = 0
        self.where: str | None = None
        self._last: dict[FrameType, int] = {}  # a frame's last instruction seen
        self._returned: set[FrameType] = set()  # frames a C function just returned to

    def __enter__(self) -> InterruptAt:
        sys.setprofile(self._profile)
        sys.settrace(self._trace)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.settrace(None)
        sys.setprofile(None)

    def _is_watched(self, code: CodeType) -> bool:
        return any(part in code.co_filename for part in self._watched)

    def _point(self, frame: FrameType) -> None:
        self.count += 1
        if self.count == self.n:
            code = frame.f_code
            self.where = f"{code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno} {code.co_name}"
            raise KeyboardInterrupt(f"interrupt point {self.n}: {self.where}")

    def _profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if event == "c_return" and frame in self._last:
            self._returned.add(frame)

    def _trace(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event != "call" or not self._is_watched(frame.f_code):
            return None
        caller = frame.f_back
        if frame.f_code.co_name in _WITH_METHODS and (
            caller is None or not self._is_watched(caller.f_code)
        ):
            return None  # the caller's own ``with`` statement: its windows are the caller's
        frame.f_trace_opcodes = True
        frame.f_trace_lines = False
        self._last[frame] = -1
        self._point(frame)  # a function's start, or a generator's resume
        return self._local

    def _local(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "opcode":
            last = self._last.get(frame, -1)
            here = frame.f_lasti
            self._last[frame] = here
            code = frame.f_code
            if frame in self._returned:
                self._returned.discard(frame)
                if last >= 0 and _handler_of(code)(last) == _handler_of(code)(here):
                    self._point(frame)
            elif last in _backward_jumps(code) and _handler_of(code)(last) == _handler_of(code)(
                here
            ):
                self._point(frame)
        elif event == "return":
            self._last.pop(frame, None)
            self._returned.discard(frame)
        return self._local


class InterruptAtCall:
    """Raise ``KeyboardInterrupt`` as the function ``name`` starts (where CPython first checks
    for a signal in it), the first time it is called from a file whose path contains
    ``called_from`` and lies itself in a file whose path contains ``inside`` (SQLAlchemy's, by
    default: the points :class:`InterruptAt` leaves out). :attr:`hit` says whether it did."""

    def __init__(self, name: str, *, called_from: str = "", inside: str = "/sqlalchemy/") -> None:
        self.name = name
        self.called_from = called_from
        self.inside = inside
        self.hit = False

    def __enter__(self) -> InterruptAtCall:
        sys.settrace(self._trace)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.settrace(None)

    def _trace(self, frame: FrameType, event: str, arg: Any) -> None:
        code = frame.f_code
        if (
            event == "call"
            and not self.hit
            and code.co_name == self.name
            and self.inside in code.co_filename
            and frame.f_back is not None
            and self.called_from in frame.f_back.f_code.co_filename
        ):
            self.hit = True
            raise KeyboardInterrupt(f"interrupted as {self.name}() started")
        return None
