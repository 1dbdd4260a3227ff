"""Ctrl-C in a command that runs a merge: one line saying what the output folder holds, exit status 130.

Until the command's callback begins, ``quiet_start``'s handler (installed by ``_autoload``) ends the process
at once with one line: nothing is written yet, and mergekit's slow imports would end in a traceback. From
``merge_started`` on, Ctrl-C raises ``KeyboardInterrupt`` again; a RAM merge turns it into
``MergeInterrupted``, which ``exit_interrupted`` prints as one line instead of click's ``Aborted!``.
"""

from __future__ import annotations

import os
import signal
from types import FrameType
from typing import NoReturn, Optional

#: 128 + SIGINT: the status a shell reports for a command that Ctrl-C ended.
EXIT_STATUS = 128 + signal.SIGINT


class MergeInterrupted(KeyboardInterrupt):
    """Ctrl-C during a RAM merge; the message says what the output folder holds."""


def before_start(out: Optional[str]) -> str:
    """The line for a Ctrl-C before any merge began to write."""
    return f"Interrupted before the merge started: {out or 'the output folder'} is untouched"


def quiet_start() -> None:
    """Ctrl-C ends the process with one line until ``merge_started``, unless SIGINT has another handler."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _quiet_exit)


def _quiet_exit(_number: int, _frame: Optional[FrameType]) -> None:
    os.write(2, (before_start(None) + "\n").encode())
    os._exit(EXIT_STATUS)  # no clean-up to run: nothing was written


def merge_started() -> None:
    """From the command's callback on, Ctrl-C raises ``KeyboardInterrupt`` again (undoes ``quiet_start``)."""
    if signal.getsignal(signal.SIGINT) is _quiet_exit:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def exit_interrupted(interrupt: KeyboardInterrupt, out: Optional[str]) -> NoReturn:
    """The one line for ``interrupt``, then exit status 130; a second Ctrl-C meanwhile is ignored."""
    import click

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    click.echo(str(interrupt) if isinstance(interrupt, MergeInterrupted) else before_start(out), err=True)
    raise SystemExit(EXIT_STATUS)
