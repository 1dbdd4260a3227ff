"""Test-only fault injection: at start-up, by putting this folder on PYTHONPATH; in a test's own process, by
``installed`` (imported as ``tests.faults.sitecustomize``, which puts back what it replaced when it ends).

``MERGEKIT_RAM_TEST_FAULT="WHERE:WHAT:N:ACTION"`` acts on the N-th matching event (1-based):

- ``open:NAME``: a file named NAME opened for writing; ACTION runs after it is closed
  (the file is complete), so a signal lands between two of mergekit's writes;
- ``fsop:any``: the output transaction's N-th file-system operation (``os.open``, ``mkdir``, ``replace``,
  ``rename``, ``link``, ``unlink``, ``rmdir``, ``fsync`` called from ``mergekit_ram/staging.py``, directly or
  through ``mergekit_ram/files.py``); ACTION runs after it (``OSError`` instead of it). ``counted``
  lists them, each as its call and first argument (``rename MERGE_INCOMPLETE``), in this process;
- ``fsop:OPERATION``: the N-th of the transaction's operations named so (``fsop:rename config.json:2``: the
  second rename of config.json), so that a test's place does not move with the operations before it;
- ``kernel:prepass`` / ``kernel:merge``: the RAM kernel counting (``count_overlaps``, the pre-pass)
  or merging (``merge_tensors``) a tensor;
- ``import:MODULE``: the module MODULE starting to import (a Ctrl-C during mergekit's imports);
- ``stderr:TEXT``: a write of TEXT to the standard error; ACTION runs after it (a Ctrl-C once a line is shown).

ACTION: a signal's name (``SIGINT``, ``SIGHUP``, ``SIGKILL``, ...: sent to this process), ``ENOSPC``
(raise ``OSError(ENOSPC)`` instead, as a full disk does), or, in this process, a function called with no
argument (a test running a second merge there, or copying the output folder as a kill there leaves it).
"""

import builtins
import contextlib
import errno
import os
import signal
import sys
import threading
import time

#: The calls of the output transaction that ``fsop`` counts.
FILE_SYSTEM_CALLS = ("open", "mkdir", "replace", "rename", "link", "unlink", "rmdir", "fsync")


def _act(action):
    if callable(action):
        action()
        return
    if action == "ENOSPC":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    os.kill(os.getpid(), int(action) if action.isdigit() else getattr(signal, action))  # handled at the next bytecode
    if action == "SIGKILL":
        time.sleep(5)


def _install(where, what, target, action, thread=None):
    """The fault; returns the function that puts back what it replaced. ``thread``: only its ``fsop`` count."""
    seen = [0]

    def hit(operation=None):
        if operation is not None and what != "any" and operation != what:
            return False
        seen[0] += 1
        return seen[0] == target

    if where == "open":
        original_open = builtins.open

        class Closing:
            def __init__(self, handle):
                self._handle = handle

            def __enter__(self):
                return self._handle.__enter__()

            def __exit__(self, *exc):
                result = self._handle.__exit__(*exc)
                if exc[0] is None and hit():
                    _act(action)
                return result

            def __getattr__(self, name):
                return getattr(self._handle, name)

        def fault_open(file, mode="r", *args, **kwargs):
            handle = original_open(file, mode, *args, **kwargs)
            if isinstance(file, (str, os.PathLike)) and os.path.basename(os.fspath(file)) == what and "w" in mode:
                return Closing(handle)
            return handle

        builtins.open = fault_open
        return lambda: setattr(builtins, "open", original_open)
    if where == "fsop":
        return file_system_calls(hit, action, thread)
    if where == "kernel":
        import mergekit.merge_methods  # noqa: F401 - first, as in a real run, so the plugin registers

        import mergekit_ram.integration.merge as merge
        import mergekit_ram.integration.methods as methods

        caller, name = {"prepass": (merge, "count_overlaps"), "merge": (methods, "merge_tensors")}[what]
        original_kernel = getattr(caller, name)

        def fault_kernel(*args, **kwargs):
            if hit():
                _act(action)
            return original_kernel(*args, **kwargs)

        setattr(caller, name, fault_kernel)
        return lambda: setattr(caller, name, original_kernel)
    if where == "stderr":
        original_stderr = sys.stderr

        class Faulting:
            def __init__(self, stream):
                self._stream = stream

            def write(self, text):
                written = self._stream.write(text)
                if what in text and hit():
                    self._stream.flush()
                    _act(action)
                return written

            def __getattr__(self, name):
                return getattr(self._stream, name)

        sys.stderr = Faulting(sys.stderr)
        return lambda: setattr(sys, "stderr", original_stderr)
    if where == "import":

        class Importing:
            def find_spec(self, fullname, path=None, target=None):
                if fullname == what and hit():
                    _act(action)
                return None

        finder = Importing()
        sys.meta_path.insert(0, finder)
        return lambda: sys.meta_path.remove(finder)
    raise ValueError(f"no fault of the kind {where!r}")


def _in_transaction():
    """Whether the caller (past os.py and files.py) is the output transaction, mergekit_ram/staging.py."""
    frame = sys._getframe(3)
    while frame is not None and frame.f_code.co_filename.endswith(
        ("<frozen os>", os.sep + "os.py", os.sep + "files.py", os.sep + "contextlib.py")
    ):
        frame = frame.f_back
    return frame is not None and frame.f_code.co_filename.endswith(os.path.join("mergekit_ram", "staging.py"))


def _ours(thread):
    """Whether this call is the output transaction's (in ``thread`` where one is given)."""
    return (thread is None or threading.current_thread() is thread) and _in_transaction()


def file_system_calls(hit, action, thread=None):
    """Wrap the file-system calls of the transaction: ``hit(operation)`` for each (its call and first argument),
    ``action`` after it where that says True (``ENOSPC``: instead of it). Returns what puts the calls back."""
    originals = {name: getattr(os, name) for name in FILE_SYSTEM_CALLS}
    for name, original in originals.items():

        def counted(*args, _original=original, _name=name, **kwargs):
            if not _ours(thread) or not hit(f"{_name} {args[0] if args else ''}"):
                return _original(*args, **kwargs)
            if action == "ENOSPC":
                _act(action)
            try:
                return _original(*args, **kwargs)
            finally:  # after the call, whether it succeeded or raised (a probe for a missing file)
                _act(action)

        setattr(os, name, counted)
    return lambda: [setattr(os, name, original) for name, original in originals.items()]


@contextlib.contextmanager
def installed(spec, action=None, thread=None):
    """The fault ``spec`` (``WHERE:WHAT:N:ACTION``, or ``WHERE:WHAT:N`` with ``action``) in this process
    while the block runs; ``thread``: counting only the transaction's calls made in that thread."""
    where, what, target, *named = spec.split(":")
    restore = _install(where, what, int(target), action if action is not None else named[0], thread)
    try:
        yield
    finally:
        restore()


@contextlib.contextmanager
def counted(thread=None):
    """The list of the transaction's file-system operations (``"rename NAME"``, ...) made while the block runs."""
    operations = []
    restore = file_system_calls(lambda operation: operations.append(operation), None, thread)
    try:
        yield operations
    finally:
        restore()


def install_faults():
    """The fault that the environment names, at start-up."""
    spec = os.environ.get("MERGEKIT_RAM_TEST_FAULT")
    if spec:
        where, what, target, action = spec.split(":")
        _install(where, what, int(target), action)


if __name__ == "sitecustomize":  # loaded at start-up: not when a test imports it
    if os.environ.get("MERGEKIT_RAM_TEST_SIGNALS") == "default":
        # The dispositions a fault test relies on, whatever the test run inherited: a shell's background job
        # (`cmd &`) starts with SIGINT and SIGQUIT ignored, `nohup make test` with SIGHUP ignored. PIPE and
        # XFSZ stay as Python sets them (ignored).
        for _number in signal.valid_signals():
            if _number not in (signal.SIGPIPE, signal.SIGXFSZ) and signal.getsignal(_number) == signal.SIG_IGN:
                signal.signal(_number, signal.default_int_handler if _number == signal.SIGINT else signal.SIG_DFL)
    install_faults()
