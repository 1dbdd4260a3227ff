"""Signals held while a merge's output folder changes, so that it holds the old or the new files.

``HeldSignals`` takes every catchable signal that ends a process by default. Outside ``held()`` the first
unwinds the merge (SIGINT as ``KeyboardInterrupt``, others as ``Interrupted``, re-sent at the end); inside,
or once unwinding, they wait. Signals with another handler (``nohup``) and other threads are left alone.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Any, Iterator

#: Not held: signals that cannot be caught or do not end a process, and crashes (SIGSEGV, SIGBUS, SIGFPE, SIGILL).
_NOT_ENDING = "SIGKILL SIGSTOP SIGSEGV SIGBUS SIGFPE SIGILL SIGCHLD SIGCONT SIGTSTP SIGTTIN SIGTTOU SIGURG SIGWINCH"
ENDING_SIGNALS = tuple(sorted(set(signal.valid_signals()) - {getattr(signal, n, 0) for n in _NOT_ENDING.split()}))


class Interrupted(BaseException):
    """A signal whose default action ends the process: unwinds the merge like Ctrl-C, then is re-sent."""

    def __init__(self, number: int) -> None:
        super().__init__(f"signal {number}")
        self.number = number


class HeldSignals:
    """The ending signals, taken on entry and given back on exit."""

    def __init__(self) -> None:
        self.previous: dict[int, Any] = {}
        self.pending: list[int] = []
        self.depth = 0
        self.unwinding = False

    def __enter__(self) -> HeldSignals:
        if threading.current_thread() is threading.main_thread():
            for number in ENDING_SIGNALS:
                if signal.getsignal(number) in (signal.SIG_DFL, signal.default_int_handler):
                    self.previous[number] = signal.signal(number, self._arrived)
        return self

    def _arrived(self, number: int, _frame: Any) -> None:
        if self.depth or self.unwinding:
            self.pending.append(number)
        else:
            self._act(number)

    def _act(self, number: int) -> None:
        self.unwinding = True
        if self.previous[number] is signal.default_int_handler:
            raise KeyboardInterrupt
        raise Interrupted(number)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Signals arriving inside wait until it ends (and the merge is not already unwinding)."""
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
        if self.pending and not self.depth and not self.unwinding:
            self._act(self.pending.pop(0))

    def __exit__(self, kind: Any, error: Any, traceback: Any) -> None:
        for number, handler in self.previous.items():
            signal.signal(number, handler)
        for number in ([error.number] if isinstance(error, Interrupted) else []) + self.pending:
            os.kill(os.getpid(), number)
        if isinstance(error, Interrupted):
            raise SystemExit(128 + error.number) from None
