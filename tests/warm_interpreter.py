"""A warm interpreter for the tests' subprocesses: a script's imports done once, each run forked.

    MERGEKIT_RAM_TEST_WARM=LISTENER,KEEPALIVE MERGEKIT_RAM_TEST_PRELOAD=MODULE,... python <folder>/<name> [ARG]

A console script started afresh spends about 7 s importing mergekit (torch, transformers, peft) and
exiting; most tests run one for a few tenths of a second of work. ``tests/conftest.py`` starts this
server under the script's own name (and, for ``mergekit-ram``, with the run's command: ``yaml``,
``probe``, ...), so that ``mergekit_ram_autoload.pth`` sees the ``argv`` a real run has at start-up.
It imports the modules MODULE, ... (what the script imports), then answers requests on the listening
``SOCK_SEQPACKET`` socket LISTENER, one per connection (from any xdist worker of the test run): JSON
``{script, args, env, cwd, limits}`` (``limits``: soft resource limits to set) with four file
descriptors (standard input, output and error, and a socket for the reply), any number at once. It
ends when the socket KEEPALIVE does (its starter gone).

Each request is a fork of this process: the child takes the descriptors, the environment, the folder,
the limits and ``argv``, installs the fault its environment names where the fault hook is loaded
(``tests/faults`` on PYTHONPATH), and runs the real script file as ``__main__``; its exit status,
uncaught exception or signal is what a run started afresh gets, and what the imports printed comes
first in its output, as in a fresh run. It ends as a fresh run does, less the teardown of the modules
(``finish``). A second fork between the two waits for the child and replies with its process id, then
its status as ``subprocess`` reports it (negative: the signal). Where the imports failed or left a
Python thread running, the server replies ``cold`` and the caller starts the script afresh. Standard
library only.
"""

import atexit
import gc
import importlib
import json
import os
import resource
import runpy
import select
import signal
import socket
import sys
import tempfile
import threading
from typing import NoReturn, Optional


def preload(modules: list[str]) -> Optional[tuple[bytes, bytes]]:
    """Import ``modules``: what that printed on standard output and error, or None where it raised or
    started a Python thread (a fork copies only the thread that calls it; the native thread pools of
    numpy's and scipy's OpenBLAS, which those imports start, stop themselves at a fork)."""
    saved = os.dup(1), os.dup(2)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
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
        printed = []
        for handle in (out, err):
            handle.seek(0)
            printed.append(handle.read())
    return (printed[0], printed[1]) if imported and threading.active_count() == 1 else None


def serve(listener: socket.socket, keepalive: socket.socket, warm: bool) -> dict:
    """Answer requests until the worker that started this server goes (``keepalive`` ends); returns (in a
    forked child only) the request to run."""
    while True:
        if keepalive in select.select([listener, keepalive], [], [])[0]:
            sys.exit(0)
        with listener.accept()[0] as connection:
            message, descriptors, _flags, _address = socket.recv_fds(connection, 1 << 20, 4)
        if not message:  # the caller went before its request
            for descriptor in descriptors:
                os.close(descriptor)
            continue
        reply = socket.socket(fileno=descriptors.pop())
        if not warm or len(descriptors) != 3:
            reply.send(b"cold")
        elif os.fork() == 0:  # the second fork, which waits
            listener.close()
            keepalive.close()
            pid = os.fork()
            if pid == 0:
                reply.close()
                for target, descriptor in enumerate(descriptors):
                    os.dup2(descriptor, target)
                    os.close(descriptor)
                return json.loads(message)
            for descriptor in descriptors:
                os.close(descriptor)
            try:
                reply.send(str(pid).encode())  # for the caller's timeout
                _pid, status = os.waitpid(pid, 0)
                reply.send(str(os.waitstatus_to_exitcode(status)).encode())
            finally:  # the caller gone (its timeout) or not, this fork ends here
                os._exit(0)
        for descriptor in descriptors:
            os.close(descriptor)
        reply.close()
        while True:  # the second forks that have replied
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break


def lower_limits(limits: dict) -> None:
    """Each soft resource limit of ``limits`` (a ``resource.RLIMIT_*`` number, or its JSON text) set."""
    for which, soft in limits.items():
        resource.setrlimit(int(which), (soft, resource.getrlimit(int(which))[1]))


def run(request: dict) -> None:
    """The script ``request["script"]`` as a fresh process runs it, in this forked child."""
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    lower_limits(request["limits"])  # as a fresh start's ``preexec_fn`` does, once the imports are done
    install_faults = getattr(sys.modules.get("sitecustomize"), "install_faults", None)
    if install_faults is not None:  # tests/faults on PYTHONPATH: this run's fault, as at start-up
        install_faults()
    script = request["script"]
    sys.argv = [script, *request["args"]]
    sys.path[0] = os.path.dirname(script)
    runpy.run_path(script, run_name="__main__")


def end() -> bool:
    """What ``Py_FinalizeEx`` does first: threads joined, atexit functions run, the standard streams
    flushed; False where a flush failed."""
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    flushed = True
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            flushed = False
    return flushed


def finish(code: object) -> NoReturn:
    """The end of a run with the status of ``sys.exit(code)`` (120 where a flush failed), as a fresh process
    ends but for the teardown of every module (``end`` does the rest): in a fork of this server it touches
    every imported object (0.5 s of copy-on-write a run). A run that leaves a file for that teardown to
    flush loses it here (its test fails); what the teardown would print (an exception ignored in a
    finalizer) is missing here, which ``test_a_warm_run_is_a_fresh_run`` compares for three runs."""
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:
        print(code, file=sys.stderr)
        status = 1
    os._exit((status if end() else 120) & 0xFF)


def exit_uncaught(error: BaseException, script: str) -> NoReturn:
    """What the interpreter does with an exception that ends the script, its traceback starting at the
    script as in a fresh run (this server's and ``runpy``'s frames left out): the report, then exit
    status 1, or for ``KeyboardInterrupt`` the clean-up and SIGINT with its default action."""
    traceback = error.__traceback__
    while traceback is not None and traceback.tb_frame.f_code.co_filename != script:
        traceback = traceback.tb_next
    sys.excepthook(type(error), error.with_traceback(traceback), traceback)  # it prints the error's own
    if not isinstance(error, KeyboardInterrupt):
        finish(1)
    end()
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)
    sys.exit(1)  # not reached


if __name__ == "__main__":
    listening, alive = (int(fd) for fd in os.environ.pop("MERGEKIT_RAM_TEST_WARM").split(","))
    printed = preload(list(filter(None, os.environ.pop("MERGEKIT_RAM_TEST_PRELOAD").split(","))))
    gc.freeze()  # the imports' objects stay out of the children's collections
    request = serve(socket.socket(fileno=listening), socket.socket(fileno=alive), printed is not None)
    for stream, data in zip((sys.stdout, sys.stderr), printed or ()):  # first, as the imports print in a fresh run
        stream.buffer.write(data)
        stream.flush()
    try:
        run(request)
    except SystemExit as ending:
        finish(ending.code)
    except BaseException as error:
        exit_uncaught(error, request["script"])
    finish(None)
