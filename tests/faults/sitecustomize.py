"""Test-only fault injection, loaded at start-up by putting this folder on PYTHONPATH.

``MERGEKIT_RAM_TEST_FAULT="WHERE:WHAT:N:ACTION"`` acts on the N-th matching event (1-based):

- ``open:NAME``: a file named NAME opened for writing; ACTION runs after it is closed
  (the file is complete), so a signal lands between two of mergekit's writes;
- ``replace:TEXT``: ``os.replace`` with TEXT in its source path (not a ``*.partial`` temporary
  file); ACTION runs after the rename;
- ``kernel:prepass`` / ``kernel:merge``: the RAM kernel counting (``count_overlaps``, the pre-pass)
  or merging (``merge_tensors``) a tensor.

ACTION: ``SIGINT``, ``SIGTERM``, ``SIGKILL`` (sent to this process), ``ENOSPC`` (raise
``OSError(ENOSPC)`` instead, as a full disk does), or ``wait`` (block until the file named by
``MERGEKIT_RAM_TEST_RELEASE`` exists, touching ``MERGEKIT_RAM_TEST_RELEASE.waiting`` first).
"""

import builtins
import errno
import os
import signal
import time

_SPEC = os.environ.get("MERGEKIT_RAM_TEST_FAULT")


def _act(action):
    if action == "ENOSPC":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    if action == "wait":
        release = os.environ["MERGEKIT_RAM_TEST_RELEASE"]
        open(release + ".waiting", "w").close()
        while not os.path.exists(release):
            time.sleep(0.02)
        return
    os.kill(os.getpid(), getattr(signal, action))
    time.sleep(0.5)  # SIGKILL lands here; handlers of the others run at the next bytecode


def _install(where, what, target, action):
    seen = [0]

    def hit():
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
    elif where == "replace":
        original_replace = os.replace

        def fault_replace(src, dst, *args, **kwargs):
            original_replace(src, dst, *args, **kwargs)
            if what in os.fspath(src) and not os.fspath(src).endswith(".partial") and hit():
                _act(action)

        os.replace = fault_replace
    elif where == "kernel":
        import mergekit.merge_methods  # noqa: F401 - first, as in a real run, so the plugin registers

        import mergekit_ram.integration.methods as methods

        name = {"prepass": "count_overlaps", "merge": "merge_tensors"}[what]
        original_kernel = getattr(methods, name)

        def fault_kernel(*args, **kwargs):
            if hit():
                _act(action)
            return original_kernel(*args, **kwargs)

        setattr(methods, name, fault_kernel)


if _SPEC:
    _where, _what, _target, _action = _SPEC.split(":")
    _install(_where, _what, int(_target), _action)
