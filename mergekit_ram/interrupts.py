"""Ctrl-C in a command that runs a merge: one line saying what the output folder holds, exit status 130; and the
plugin's warnings in such a command as plain ``warning: ...`` lines (``PlainWarnings``). Standard library only (not
even typing): the start-up hook imports it in mergekit's merging scripts.

In mergekit's console scripts the start-up hook (``_autoload``) installs ``quiet_start``: until a RAM merge
begins, Ctrl-C ends the process at once with one line (nothing is written yet; mergekit's slow imports would
end in a traceback). Inside the merge (``merge_started``), Ctrl-C raises ``KeyboardInterrupt`` again, which the
seam turns into ``errors.MergeInterrupted``; after it (``merge_ended``), Ctrl-C ends the process with the line that
says the folder holds the complete new merge. Elsewhere (the Python API) SIGINT is left as it is.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from types import FrameType

#: 128 + SIGINT: the status a shell reports for a command that Ctrl-C ended.
EXIT_STATUS = 128 + signal.SIGINT
BEFORE_START = "Interrupted before the merge started: the output folder is untouched"


class _QuietExit:
    """A SIGINT handler that writes one line and ends the process at once with status 130."""

    def __init__(self, message: str) -> None:
        self.message = message

    def __call__(self, _number: int, _frame: FrameType | None) -> None:
        os.write(2, (self.message + "\n").encode())
        os._exit(EXIT_STATUS)


def quiet_start() -> None:
    """Ctrl-C ends the process with one line until a merge starts, unless SIGINT has another handler."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _QuietExit(BEFORE_START))


class Quiet:
    """Meanwhile Ctrl-C ends the process at once with ``message`` (for a command that writes nothing meanwhile: no
    library's half-finished import or caught exception is mistaken for a finding), unless SIGINT has another
    handler; as it was after."""

    def __init__(self, message: str) -> None:
        self.message = message
        self.previous: object = None

    def __enter__(self) -> None:
        self.previous = signal.getsignal(signal.SIGINT)
        if self.previous is signal.default_int_handler:
            signal.signal(signal.SIGINT, _QuietExit(self.message))

    def __exit__(self, *_exception: object) -> None:
        if self.previous is signal.default_int_handler:
            signal.signal(signal.SIGINT, self.previous)


def merge_started() -> bool:
    """Ctrl-C raises ``KeyboardInterrupt`` again; whether a console script's quiet handler was there."""
    if isinstance(signal.getsignal(signal.SIGINT), _QuietExit):
        signal.signal(signal.SIGINT, signal.default_int_handler)
        return True
    return False


def merge_ended(message: str) -> None:
    """After a console script's merge: Ctrl-C ends it with ``message`` (what the folder holds)."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _QuietExit(message))


class PlainWarnings(logging.StreamHandler):
    """The plugin's log records in a console script: a warning (or error) as ``warning: <message>``, without the
    ``WARNING:mergekit_ram.<module>:`` that mergekit's scripts' ``logging.basicConfig`` puts before it; the rest
    (INFO under ``-v``) as that format. Written to the standard error of the moment."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter(logging.BASIC_FORMAT))

    @property
    def stream(self):  # the standard error of the moment (a test's capture, too)
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass

    def format(self, record: logging.LogRecord) -> str:
        if record.levelno < logging.WARNING:
            return super().format(record)
        text = f"{record.levelname.lower()}: {record.getMessage()}"
        return text + "\n" + logging.Formatter().formatException(record.exc_info) if record.exc_info else text

    @classmethod
    def install(cls) -> PlainWarnings:
        """On the plugin's logger, instead of the root's handlers (once); returns the handler in place."""
        logger = logging.getLogger("mergekit_ram")
        found = next((handler for handler in logger.handlers if isinstance(handler, cls)), None)
        if found is None:
            found = cls()
            logger.addHandler(found)
        logger.propagate = False
        return found
