"""Test-only fault injection, loaded at start-up by putting this folder on PYTHONPATH.

``MERGEKIT_RAM_TEST_FAULT="WHERE:WHAT:N:ACTION"`` acts on the N-th matching event (1-based):

- ``open:NAME``: a file named NAME opened for writing; ACTION runs after it is closed
  (the file is complete), so a signal lands between two of mergekit's writes;
- ``fsop:any``: the output transaction's N-th file-system operation (``os.open``, ``mkdir``, ``replace``,
  ``rename``, ``link``, ``unlink``, ``rmdir``, ``fsync`` called from ``mergekit_ram/staging.py``, directly or
  through ``mergekit_ram/files.py``); ACTION runs after it (``OSError`` instead of it). With
  ``MERGEKIT_RAM_TEST_COUNT=FILE`` and no fault, the number of such operations is written to FILE
  at exit, and each (its number, call and first argument) to FILE.trace (tests/test_transaction.py
  enumerates them);
- ``kernel:prepass`` / ``kernel:merge``: the RAM kernel counting (``count_overlaps``, the pre-pass)
  or merging (``merge_tensors``) a tensor;
- ``import:MODULE``: the module MODULE starting to import (a Ctrl-C during mergekit's imports);
- ``stderr:TEXT``: a write of TEXT to the standard error; ACTION runs after it (a Ctrl-C once a line is shown).

ACTION: a signal's name (``SIGINT``, ``SIGHUP``, ``SIGKILL``, ...: sent to this process), ``ENOSPC``
(raise ``OSError(ENOSPC)`` instead, as a full disk does), or ``wait`` (block until the file named by
``MERGEKIT_RAM_TEST_RELEASE`` exists, touching ``MERGEKIT_RAM_TEST_RELEASE.waiting`` first).
"""

import atexit
import builtins
import errno
import os
import signal
import sys
import time


def _act(action):
    if action == "ENOSPC":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    if action == "wait":
        release = os.environ["MERGEKIT_RAM_TEST_RELEASE"]
        open(release + ".waiting", "w").close()
        while not os.path.exists(release):
            time.sleep(0.02)
        return
    os.kill(os.getpid(), int(action) if action.isdigit() else getattr(signal, action))  # handled at the next bytecode
    if action == "SIGKILL":
        time.sleep(5)


def _install(where, what, target, action):
    seen = [0]

    def hit(_operation=None):
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
    elif where == "fsop":
        _install_fsop(hit, action)
    elif where == "kernel":
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
    elif where == "stderr":

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
    elif where == "import":

        class Importing:
            def find_spec(self, fullname, path=None, target=None):
                if fullname == what and hit():
                    _act(action)
                return None

        sys.meta_path.insert(0, Importing())


def _in_transaction():
    """Whether the caller (past os.py and files.py) is the output transaction, mergekit_ram/staging.py."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.endswith(
        ("<frozen os>", os.sep + "os.py", os.sep + "files.py", os.sep + "contextlib.py")
    ):
        frame = frame.f_back
    return frame is not None and frame.f_code.co_filename.endswith(os.path.join("mergekit_ram", "staging.py"))


def _install_fsop(hit, action):
    """Wrap the file-system calls of the transaction: act after the N-th (``ENOSPC``: instead of it)."""
    for name in ("open", "mkdir", "replace", "rename", "link", "unlink", "rmdir", "fsync"):
        original = getattr(os, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            if not _in_transaction() or not hit(f"{_name} {args[0] if args else ''}"):
                return _original(*args, **kwargs)
            if action == "ENOSPC":
                _act(action)
            try:
                return _original(*args, **kwargs)
            finally:  # after the call, whether it succeeded or raised (a probe for a missing file)
                _act(action)

        setattr(os, name, counted)


if os.environ.get("MERGEKIT_RAM_TEST_SIGNALS") == "default":
    # The dispositions a fault test relies on, whatever the test run inherited: a shell's background job
    # (`cmd &`) starts with SIGINT and SIGQUIT ignored, `nohup make test` with SIGHUP ignored. PIPE and
    # XFSZ stay as Python sets them (ignored).
    for _number in signal.valid_signals():
        if _number not in (signal.SIGPIPE, signal.SIGXFSZ) and signal.getsignal(_number) == signal.SIG_IGN:
            signal.signal(_number, signal.default_int_handler if _number == signal.SIGINT else signal.SIG_DFL)


def install_faults():
    """The fault or the count that the environment names, at start-up."""
    spec = os.environ.get("MERGEKIT_RAM_TEST_FAULT")
    if spec:
        where, what, target, action = spec.split(":")
        _install(where, what, int(target), action)
    elif os.environ.get("MERGEKIT_RAM_TEST_COUNT"):
        counted = []

        def count(operation):
            counted.append(operation)
            return False

        def write_count():
            with open(os.environ["MERGEKIT_RAM_TEST_COUNT"], "w") as handle:
                handle.write(str(len(counted)))
            with open(os.environ["MERGEKIT_RAM_TEST_COUNT"] + ".trace", "w") as handle:
                handle.writelines(f"{number} {operation}\n" for number, operation in enumerate(counted, 1))

        _install_fsop(count, "none")
        atexit.register(write_count)


install_faults()
