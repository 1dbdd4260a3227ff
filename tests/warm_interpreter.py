"""A warm interpreter for ``tests/conftest.run_script``: a console script's imports done once, each run forked.

    MERGEKIT_RAM_TEST_WARM=FD python <folder>/<script name> [yaml]

Every run of a console script spends about 5.5 s importing mergekit (torch, transformers, peft) before
it does anything; most tests run one for a few tenths of a second of work. This server is started
under the script's own name (and, for ``mergekit-ram``, ``yaml`` where the run is one of its merge
runners), so that ``mergekit_ram_autoload.pth`` sees the ``argv`` a real run has at interpreter start.
It imports what the script imports, then answers requests on the ``SOCK_SEQPACKET`` socket FD: JSON
``{script, args, env, cwd}`` with three file descriptors (standard input, output and error).

Each request is a fork of this process: the child takes the descriptors, the environment, the folder
and ``argv``, and runs the real console script file as ``__main__``; its exit status, uncaught
exception or signal is the interpreter's own, as in a run started afresh. The server replies with the
status as ``subprocess`` reports it (negative: the signal). A real run would show in its own output
what its imports print, and would fail where they fail: where they printed anything, failed, or left
a Python thread running, the server answers ``cold`` and the caller starts the script afresh.
Standard library only.
"""

import atexit
import gc
import importlib
import importlib.metadata
import json
import os
import runpy
import signal
import socket
import sys
import tempfile
import threading
from typing import NoReturn

#: Imported before the first request, beside the script's own module: what ``mergekit-ram``'s merge
#: runners import when they run.
MERGE_SCRIPTS = ("mergekit.scripts.run_yaml", "mergekit.scripts.multimerge", "mergekit.scripts.merge_raw_pytorch")


def preload(name: str) -> bool:
    """Import the console script ``name``'s module; whether that printed nothing, raised nothing and
    started no Python thread (a fork copies only the thread that calls it; the native thread pools
    of numpy's and scipy's OpenBLAS, which those imports start, stop themselves at a fork)."""
    entries = importlib.metadata.entry_points(group="console_scripts", name=name)
    if len(entries) != 1:  # found through another distribution than the script's own: a fresh run
        return False
    (entry,) = entries
    modules = [entry.module, *(MERGE_SCRIPTS if name == "mergekit-ram" else ())]
    saved = os.dup(1), os.dup(2)
    with tempfile.TemporaryFile() as printed:
        os.dup2(printed.fileno(), 1)
        os.dup2(printed.fileno(), 2)
        try:
            for module in modules:
                importlib.import_module(module)
            imported = True
        except BaseException:  # a real run fails the same way, in its own output
            imported = False
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
        silent = printed.seek(0, os.SEEK_END) == 0
    return imported and silent and threading.active_count() == 1


def serve(channel: socket.socket, warm: bool) -> dict:
    """Answer requests until the caller goes; returns (in a forked child only) the request to run."""
    while True:
        message, descriptors, _flags, _address = socket.recv_fds(channel, 1 << 20, 3)
        if not message:
            sys.exit(0)
        if not warm or len(descriptors) != 3:
            for descriptor in descriptors:
                os.close(descriptor)
            channel.send(b"cold")
            continue
        pid = os.fork()
        if pid == 0:
            channel.close()
            for target, descriptor in enumerate(descriptors):
                os.dup2(descriptor, target)
                os.close(descriptor)
            return json.loads(message)
        for descriptor in descriptors:
            os.close(descriptor)
        _pid, status = os.waitpid(pid, 0)
        channel.send(str(os.waitstatus_to_exitcode(status)).encode())


def run(request: dict) -> None:
    """The console script ``request["script"]`` as a fresh process runs it, in this forked child."""
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    script = request["script"]
    sys.argv = [script, *request["args"]]
    sys.path[0] = os.path.dirname(script)
    runpy.run_path(script, run_name="__main__")


def exit_uncaught(error: BaseException, script: str) -> NoReturn:
    """What the interpreter does with an exception that ends the script, its traceback starting at the
    script as in a fresh run (this server's and ``runpy``'s frames left out): the report, then exit
    status 1, or for ``KeyboardInterrupt`` the clean-up and SIGINT with its default action."""
    traceback = error.__traceback__
    while traceback is not None and traceback.tb_frame.f_code.co_filename != script:
        traceback = traceback.tb_next
    sys.excepthook(type(error), error.with_traceback(traceback), traceback)  # it prints the error's own
    if not isinstance(error, KeyboardInterrupt):
        sys.exit(1)
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)
    sys.exit(1)  # not reached


if __name__ == "__main__":
    channel = socket.socket(fileno=int(os.environ.pop("MERGEKIT_RAM_TEST_WARM")))
    warm = preload(os.path.basename(sys.argv[0]))
    gc.freeze()  # the imports' objects stay out of the children's collections: 1.6 s to exit becomes 0.4 s
    request = serve(channel, warm)
    try:
        run(request)
    except SystemExit:
        raise
    except BaseException as error:
        exit_uncaught(error, request["script"])
