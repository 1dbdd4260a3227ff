"""The output transaction, enumerated: every file-system operation it makes, each way a process can
end there, what a killed run leaves and what the next merge makes of it, and crafted folder states
(the invariants are at the top of mergekit_ram/staging.py).

Each run is the real transaction with tests/faults/transaction.py standing in for mergekit's writes (a
run takes milliseconds); faults come from tests/faults/sitecustomize.py, which counts the file-system
calls staging.py makes and acts after the N-th. In this process: a failed call (ENOSPC), a second merge
while the first holds OUT (the first paused there, or in a thread), crafted folder states, and what a
SIGKILL leaves: right after operation N that is the folder as it is then, which one merge copies after
each of its operations (``killed_at_each_operation``). A signal, which ends a process, ends a child
forked from this process and started as a new interpreter starts (``in_a_child``); those tests are
marked ``process``, and the SIGKILL sweep checks that a real kill leaves exactly the copied states.

``make test`` runs a subset (every operation with SIGINT, SIGTERM, SIGHUP, SIGKILL and ENOSPC; every
signal at three operations; the next merge over two crash states with SIGTERM, SIGKILL and ENOSPC at
each of its operations); the whole sweep is

    MERGEKIT_RAM_FULL_SWEEP=1 .venv/bin/python -m pytest tests/test_transaction.py -n 2
"""

from __future__ import annotations

import contextlib
import errno
import faulthandler
import functools
import hashlib
import io
import itertools
import json
import logging
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Collection, NoReturn, Optional, Union

import pytest

from mergekit_ram.signals import ENDING_SIGNALS
from mergekit_ram.staging import (
    LOCK_FILE,
    MANIFEST_FILE,
    MARKER_FILE,
    MARKER_TEXT,
    PRIVATE_PREFIX,
    OutputBusyError,
    OutputFolderError,
    folder_writer,
    output_transaction,
    replace_files,
)
from tests.conftest import hang_fails, plugin_log
from tests.faults import sitecustomize as faults
from tests.faults.transaction import main as merge_as_driver

FULL = os.environ.get("MERGEKIT_RAM_FULL_SWEEP") == "1"
SIGNALS = [signal.Signals(number).name if number in signal.Signals._value2member_map_ else str(number)
           for number in ENDING_SIGNALS]  # fmt: skip
#: The endings that end a process, each at every operation (ENOSPC, a failed call, runs in this process).
SIGNAL_ENDINGS = [*SIGNALS, "SIGKILL"] if FULL else ["SIGINT", "SIGTERM", "SIGHUP", "SIGKILL"]
USER_FILES = {
    "notes.txt": b"my notes\n",
    "adapter_model.safetensors": b"not really an adapter",
    "pytorch_model_backup.bin": b"a backup",
    os.path.join("evals", "run.sh"): b"#!/bin/sh\n",
}
NOTES = "notes-written-during-the-merge.txt"  # the user's file in the "fresh" scenario
LEFT_OVER_WARNING = "left by a mergekit-ram merge that did not finish"
State = Optional[dict[str, bytes]]
#: What a fault does at its operation: ENOSPC, a signal's name (in a child), or a function (in this process).
Action = Union[str, Callable[[], None]]


def snapshot(folder: str) -> State:
    """Every entry under ``folder`` by relative path: a file's bytes, a link's target, b"<folder>", b"<fifo>".

    A private folder's random name reads ``.mergekit-ram-<private>``."""
    if not os.path.lexists(folder):
        return None
    found: dict[str, bytes] = {}
    for root, folders, files in os.walk(folder):
        for name in folders + files:
            path = os.path.join(root, name)
            if os.path.islink(path):
                found[_relative(path, folder)] = b"-> " + os.readlink(path).encode()
            elif os.path.isdir(path):
                found[_relative(path, folder)] = b"<folder>"
            elif not os.path.isfile(path):
                found[_relative(path, folder)] = b"<fifo>"
            else:
                with open(path, "rb") as handle:
                    found[_relative(path, folder)] = handle.read()
    return found


def _relative(path: str, folder: str) -> str:
    return re.sub(r"^\.mergekit-ram-[0-9a-f]{16}(?=/|$)", ".mergekit-ram-<private>", os.path.relpath(path, folder))


# The driver's merge: in this process, in a forked child, and the states a kill leaves ---------------------


def drive(
    out: str,
    *arguments: str,
    fault: Optional[tuple[int, Action]] = None,
    meanwhile: Optional[Callable[[], None]] = None,
) -> subprocess.CompletedProcess:
    """The driver's merge into ``out`` in this process (``arguments``: its GENERATION and flags; ``meanwhile``:
    what ``pause`` runs), ``fault`` (operation, ENOSPC or a function) installed for its thread meanwhile. Its
    exit status and standard error as its own process would end and print them: the plugin's warnings, then 0,
    or 1 and a SystemExit's message or an error's traceback. A failed assertion of the test is raised."""
    thread = threading.current_thread()
    installed = faults.installed(f"fsop:any:{fault[0]}", fault[1], thread) if fault else contextlib.nullcontext()
    code, printed = 0, ""
    with plugin_log(logging.WARNING, this_thread=True) as logged:
        try:
            with installed:
                merge_as_driver(out, *arguments, **({"meanwhile": meanwhile} if meanwhile else {}))
        except AssertionError:
            raise
        except SystemExit as ended:
            code, printed = (1, f"{ended.code}\n") if isinstance(ended.code, str) else (ended.code or 0, "")
        except Exception as error:
            code, printed = 1, "".join(traceback.format_exception(error))
    return subprocess.CompletedProcess(["driver", out, *arguments], code, "", logged.getvalue() + printed)


def forked(out: str, *arguments: str, fault: tuple[int, str], nohup: bool = False) -> subprocess.CompletedProcess:
    """The driver's merge into ``out`` in a child (``in_a_child``), ``fault`` (operation, a signal's name or
    ENOSPC) installed there; started as ``nohup`` starts it where asked (SIGHUP ignored)."""

    def merge() -> None:
        with faults.installed(f"fsop:any:{fault[0]}:{fault[1]}"):
            merge_as_driver(out, *arguments)

    return in_a_child(merge, ignored={signal.SIGHUP} if nohup else ())


def in_a_child(work: Callable[[], object], ignored: Collection[int] = ()) -> subprocess.CompletedProcess:
    """``work()`` in a child forked from this process, which starts as a new interpreter starts and ends as one
    ends (``_as_a_process``): its exit status as ``subprocess.run`` reports it (-N: ended by signal N) and its
    standard error. No exec: the child has this process's imports, so a run takes milliseconds."""
    with tempfile.TemporaryFile() as stderr:
        pid = os.fork()
        if pid == 0:
            _as_a_process(work, stderr.fileno(), ignored)
        status = os.waitpid(pid, 0)[1]
        stderr.seek(0)
        return subprocess.CompletedProcess(["child"], os.waitstatus_to_exitcode(status), "", stderr.read().decode())


def _as_a_process(work: Callable[[], object], stderr: int, ignored: Collection[int]) -> NoReturn:
    """In the child: every ending signal at the disposition a new interpreter gives it (SIGINT raising
    KeyboardInterrupt, SIGPIPE and SIGXFSZ ignored, the others ending the process; ``ignored`` ignored, as
    inherited), WARNING records and an uncaught error's traceback on ``stderr``, no core file; then ``work()``,
    and the end CPython makes: 0, a SystemExit's status (its message printed: 1), 1 after an error, SIGINT
    after an uncaught KeyboardInterrupt."""
    code = 1
    try:
        os.dup2(stderr, 2)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True)
        faulthandler.disable()
        resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
        python = {signal.SIGINT: signal.default_int_handler, signal.SIGPIPE: signal.SIG_IGN}
        python[signal.SIGXFSZ] = signal.SIG_IGN
        for number in ENDING_SIGNALS:
            with contextlib.suppress(OSError, ValueError):  # one the C library keeps for itself
                signal.signal(number, signal.SIG_IGN if number in ignored else python.get(number, signal.SIG_DFL))
        handler = logging.StreamHandler(sys.stderr)  # logging's last resort in a new interpreter
        handler.setLevel(logging.WARNING)
        logging.root.handlers = [handler]
        work()
        code = 0
    except SystemExit as ended:
        if isinstance(ended.code, str):
            print(ended.code, file=sys.stderr)
        code = ended.code if isinstance(ended.code, int) else 0 if ended.code is None else 1
    except KeyboardInterrupt:
        traceback.print_exc()
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(BaseException):
            sys.stderr.flush()
        os._exit(code)


def killed_at_each_operation(out: str, *arguments: str) -> tuple[dict[int, str], list[str]]:
    """What a SIGKILL right after each of the transaction's operations leaves, found in this process: the
    driver's merge into ``out``, which copies ``out`` (links as links, modes kept) into ``out-killed/N`` right
    after operation N; a process killed there holds nothing more (its lock goes with it). The copies'
    folders by operation (one that does not exist where ``out`` did not), and the operations made."""
    copies: dict[int, str] = {}
    operations: list[str] = []

    def copy() -> None:
        number = len(operations)
        copies[number] = os.path.join(f"{out}-killed", str(number), os.path.basename(out))
        if os.path.lexists(out):
            shutil.copytree(out, copies[number], symlinks=True)

    def counted(operation: str) -> bool:
        operations.append(operation)
        return True

    restore = faults.file_system_calls(counted, copy, threading.current_thread())
    try:
        completed = drive(out, *arguments)
    finally:
        restore()
    assert completed.returncode == 0, completed.stderr
    return copies, operations


def operations(out: str, *arguments: str) -> list[str]:
    """The file-system operations the transaction makes in this run (which happens on ``out``)."""
    with faults.counted(threading.current_thread()) as made:
        completed = drive(out, *arguments)
    assert completed.returncode in (0, 1), completed.stderr
    return made


def left_over(state: State) -> list[str]:
    """What a run that did not finish leaves: the marker, private folders (and what is in them), its lock file."""
    return sorted(
        name
        for name in state or {}
        if name in (MARKER_FILE, LOCK_FILE) or (name.startswith(PRIVATE_PREFIX) and name != MANIFEST_FILE)
    )


def unlocked(state: State) -> State:
    """``state`` without a killed run's lock file, which the next run takes over and removes (it holds nothing)."""
    return None if state is None else {name: data for name, data in state.items() if name != LOCK_FILE}


def published(state: State) -> dict[str, bytes]:
    """``state`` without what ``left_over`` names."""
    return {name: data for name, data in (state or {}).items() if name.split(os.sep)[0] not in left_over(state)}


def ended_as_asked(completed: subprocess.CompletedProcess, ending: str) -> bool:
    """The run ended as the fault says: by the signal (unless Python ignores it: it then
    finishes), or with an error for ENOSPC (unless the failed call was one the code expects to
    fail, or a clean-up: it then finishes)."""
    if ending == "ENOSPC":
        return completed.returncode in (0, 1)
    number = getattr(signal, ending, None) or int(ending)
    return completed.returncode in ((-number, 0) if ending in ("SIGPIPE", "SIGXFSZ") else (-number,))


@dataclass
class Scenario:
    """How to make the folder before a merge, that folder, the same folder after the merge, and the
    operations between."""

    root: str
    fresh: bool
    old: State = None
    new: State = None
    count: int = 0

    @property
    def flags(self) -> tuple[str, ...]:
        return ("user-file",) if self.fresh else ()

    def make(self, name: str) -> str:
        """A new folder in the old state: an earlier merge run there (so its manifest records these
        files' sizes and SHA-256), user files, a user folder and a link; nothing for a fresh scenario."""
        out = os.path.join(self.root, name, "out")
        os.makedirs(os.path.dirname(out))
        if self.fresh:
            return out
        assert drive(out, "old").returncode == 0
        for path, data in USER_FILES.items():
            os.makedirs(os.path.dirname(os.path.join(out, path)), exist_ok=True)
            with open(os.path.join(out, path), "wb") as handle:
                handle.write(data)
        os.symlink(os.path.join(self.root, "outside.txt"), os.path.join(out, "latest"))
        return out

    @functools.cached_property
    def killed(self) -> dict[int, str]:
        """{operation: a folder as a SIGKILL of the new merge right after it leaves it} (never changed: copy it)."""
        return killed_at_each_operation(self.make("killed"), "new", *self.flags)[0]

    def olds(self) -> list[State]:
        """What counts as the old state: a merge into a new folder may leave nothing, or the user's file."""
        return [self.old] if not self.fresh else [None, {NOTES: b"the user's notes\n"}]

    def phase(self, state: State) -> int:
        """0: OUT holds what it held before; 2: the complete new merge; 1: a mix (only after SIGKILL)."""
        files = published(state)
        if files == self.new:
            return 2
        return 0 if files in self.olds() or (self.fresh and not files) else 1


def _scenario(root: str, fresh: bool) -> Scenario:
    scenario = Scenario(root, fresh)
    scenario.old = snapshot(scenario.make("old"))
    new_out = scenario.make("new")
    assert drive(new_out, "new", *scenario.flags).returncode == 0
    scenario.new = snapshot(new_out)
    scenario.count = len(operations(scenario.make("count"), "new", *scenario.flags))
    return scenario


@pytest.fixture(scope="module")
def remerge(tmp_path_factory: pytest.TempPathFactory) -> Scenario:
    """A folder with an earlier merge (3 shards), user files, a user folder and a link; the new merge has 2 shards."""
    return _scenario(str(tmp_path_factory.mktemp("remerge")), fresh=False)


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory) -> Scenario:
    """A merge into a folder that does not exist yet; the user writes a file into it while the merge runs."""
    return _scenario(str(tmp_path_factory.mktemp("fresh")), fresh=True)


def test_the_scenarios_are_what_they_claim(remerge: Scenario, fresh: Scenario) -> None:
    assert remerge.old is not None and remerge.new is not None and fresh.new is not None
    assert "model-00003-of-00003.safetensors" in remerge.old and "model-00003-of-00003.safetensors" not in remerge.new
    assert all(remerge.new[name] == data for name, data in USER_FILES.items())
    assert remerge.new["latest"] == remerge.old["latest"] and not left_over(remerge.new)
    assert fresh.new[NOTES] == b"the user's notes\n" and not left_over(fresh.new)
    assert remerge.count == 50 and fresh.count == 36  # the operations enumerated below
    assert len(remerge.killed) == remerge.count and len(fresh.killed) == fresh.count


# Every operation, every ending (invariant 6) --------------------------------------------------------------


def _fault(scenario: Scenario, operation: int, ending: str, tag: str = "every") -> int:
    """Fault ``ending`` at ``operation`` (ENOSPC in this process, a signal in a child): the phase it leaves (see
    ``Scenario.phase``), checked; after SIGKILL, the state ``Scenario.killed`` copied there."""
    out = scenario.make(f"{tag}-{ending}-{operation}")
    run = drive if ending == "ENOSPC" else forked
    completed = run(out, "new", *scenario.flags, fault=(operation, ending))
    assert ended_as_asked(completed, ending), (operation, ending, completed.returncode, completed.stderr[-2000:])
    state = snapshot(out)
    phase = scenario.phase(state)
    if ending == "SIGKILL":
        assert state == snapshot(scenario.killed[operation]), operation  # what the tests in this process take
        if phase == 1:  # killed while files moved: marked, and no loader takes the mix for a model
            assert MARKER_FILE in (state or {}) and "config.json" not in published(state), operation
    elif ending == "ENOSPC" and phase == 2:  # a failed clean-up: said, and only the private folder stays
        assert MARKER_FILE not in (state or {}) and (not left_over(state) or "could not remove" in completed.stderr)
    else:
        assert phase != 1 and not left_over(state), (operation, ending, left_over(state), completed.stderr[-2000:])
    if ending == "ENOSPC" and phase == 0:  # a failed publish is never published later (no replay)
        assert drive(out, "new", "fail").returncode == 1 and snapshot(out) == state, operation
    return phase


def _at_every_operation(name: str, scenario: Scenario, ending: str) -> None:
    """Invariant 6: at every operation, the old state or the new merge (a mix only after SIGKILL, marked)."""
    phases = [_fault(scenario, operation, ending) for operation in range(1, scenario.count + 1)]
    if ending in ("SIGPIPE", "SIGXFSZ"):  # Python ignores them (a failed write raises instead): the merge goes on
        assert set(phases) == {2}
    else:
        assert 0 in phases and 2 in phases  # a fault before publishing, and one after
    if ending != "ENOSPC":  # a failed fsync of a folder is tolerated, so ENOSPC may publish anywhere
        assert phases == sorted(phases), phases  # once new, new
    if ending == "SIGKILL" and name == "remerge":
        assert 1 in phases  # the enumeration reaches the middle of publishing


def _every_signal_at_three_operations(scenario: Scenario) -> None:
    operations = (1, scenario.count // 2, scenario.count)
    cases = itertools.product(operations, SIGNALS)
    assert {_fault(scenario, operation, ending, "three") for operation, ending in cases} == {0, 2}


def _an_ignored_sighup_stays_ignored(scenario: Scenario) -> None:
    """A merge started under ``nohup`` goes on after a SIGHUP (the terminal closed), wherever it lands."""
    for operation in (1, scenario.count // 2, scenario.count):
        out = scenario.make(f"nohup-{operation}")
        completed = forked(out, "new", fault=(operation, "SIGHUP"), nohup=True)
        assert completed.returncode == 0 and snapshot(out) == scenario.new, (operation, completed.stderr[-2000:])


#: (scenario, ending, where): the ending at every operation; besides, every signal at three operations (the full
#: sweep runs each at every one) and SIGHUP under nohup at three.
SWEEP = [(name, ending, "every operation") for name in ("remerge", "fresh") for ending in SIGNAL_ENDINGS]
SWEEP += [("remerge", "SIGHUP", "three under nohup")] + ([] if FULL else [("remerge", "every signal", "three")])


@pytest.mark.process
@pytest.mark.parametrize(("name", "ending", "where"), SWEEP, ids=[" ".join(case) for case in SWEEP])
def test_every_operation_with_every_ending(name: str, ending: str, where: str, request: pytest.FixtureRequest) -> None:
    """Invariant 6 where a signal ends the process (in a child); ENOSPC: ``test_a_full_disk_at_every_operation``."""
    scenario: Scenario = request.getfixturevalue(name)
    if where == "three":
        _every_signal_at_three_operations(scenario)
    elif where == "three under nohup":
        _an_ignored_sighup_stays_ignored(scenario)
    else:
        _at_every_operation(name, scenario, ending)


@pytest.mark.parametrize("name", ["remerge", "fresh"])
def test_a_full_disk_at_every_operation(name: str, request: pytest.FixtureRequest) -> None:
    """Invariant 6 with ENOSPC at every operation: an error while publishing is undone by the same process."""
    _at_every_operation(name, request.getfixturevalue(name), "ENOSPC")


# What a killed run leaves, and the next merge (invariant 1: no replay) ---------------------------


def _crashed(scenario: Scenario, operation: int, tag: str) -> str:
    """A new folder as a merge killed (SIGKILL) right after ``operation`` leaves it: ``Scenario.killed``'s, copied
    (the manifest records sizes and SHA-256, which a copy keeps)."""
    out = os.path.join(scenario.root, f"crash-{operation}-{tag}", "out")
    shutil.copytree(scenario.killed[operation], out, symlinks=True)
    return out


@pytest.fixture(scope="module")
def crashes(remerge: Scenario) -> dict[int, State]:
    """Each distinct folder a SIGKILL leaves with something of the plugin's in it: {operation: state}."""
    found: dict[int, State] = {}
    for operation in range(1, remerge.count + 1):
        state = snapshot(remerge.killed[operation])
        if left_over(state) and state not in found.values():
            found[operation] = state
    assert len(found) == 39 and {remerge.phase(state) for state in found.values()} == {0, 1, 2}
    return found


def _after_a_crash(scenario: Scenario, operation: int, state: State) -> None:
    """What follows a crash: a failing RAM merge changes nothing and says what it found; a RAM merge
    publishes exactly its own result (the killed run's private folder stays, as found); a merge with
    another method, then a failing RAM merge, keep that merge's files."""
    out = _crashed(scenario, operation, "failing")
    failing = drive(out, "new", "fail")
    assert failing.returncode == 1 and unlocked(snapshot(out)) == unlocked(state), operation
    assert LEFT_OVER_WARNING in failing.stderr or left_over(state) == [LOCK_FILE]
    assert MARKER_FILE in failing.stderr or MARKER_FILE not in (state or {})
    out = _crashed(scenario, operation, "merged")
    assert drive(out, "new").returncode == 0
    after = snapshot(out) or {}
    assert published(after) == scenario.new and MARKER_FILE not in after and LOCK_FILE not in after, operation
    private = [name for name in left_over(state) if name not in (MARKER_FILE, LOCK_FILE)]
    assert {name: data for name, data in after.items() if name not in published(after)} == {
        name: data for name, data in (state or {}).items() if name.split(os.sep)[0] in private
    }
    out = _crashed(scenario, operation, "plain")
    assert drive(out, "plain", "plain").returncode == 0
    plain = snapshot(out) or {}
    assert drive(out, "new", "fail").returncode == 1 and unlocked(snapshot(out)) == unlocked(plain), operation
    assert plain["model-00001-of-00003.safetensors"] == b"plain model-00001-of-00003.safetensors\n"


def test_a_killed_publish_is_never_replayed(remerge: Scenario, crashes: dict[int, State]) -> None:
    """Invariant 1 at every distinct crash state: nothing completes, restores or undoes it."""
    for operation, state in crashes.items():
        _after_a_crash(remerge, operation, state)


def _next_merge_fault(scenario: Scenario, crashed: int, operation: int, ending: str) -> None:
    out = _crashed(scenario, crashed, f"{ending}-{operation}")
    before = snapshot(out)
    run = drive if ending == "ENOSPC" else forked
    completed = run(out, "new", fault=(operation, ending))
    assert ended_as_asked(completed, ending) or completed.returncode == 1, (operation, ending, completed.stderr)
    state = snapshot(out)
    files = published(state)
    if completed.returncode == 0:  # it finished (Python ignores SIGPIPE and SIGXFSZ): its merge, no marker
        assert files == scenario.new and MARKER_FILE not in (state or {}), (crashed, operation, ending)
    elif unlocked(state) != unlocked(before) and (files != scenario.new or MARKER_FILE in (state or {})):
        # only SIGKILL leaves something: its private folder (OUT's files as they were), or the marker over
        # a mix (no config.json) or over the complete new merge (killed before removing the marker)
        marked = MARKER_FILE in (state or {}) and ("config.json" not in files or files == scenario.new)
        assert ending == "SIGKILL" and (files == published(before) or marked), (crashed, operation, ending)


def _over_crashes(scenario: Scenario, crashes: dict[int, State], ending: str) -> None:
    """A fault at any operation of the merge that follows a crash: the crash state, or the new merge
    (the subset: two crash states in the middle of publishing)."""
    middle = [operation for operation, state in crashes.items() if scenario.phase(state) == 1]
    for crashed in list(crashes) if FULL else middle[1:3]:
        count = len(operations(_crashed(scenario, crashed, f"count-{ending}"), "new"))
        for operation in range(1, count + 1):
            _next_merge_fault(scenario, crashed, operation, ending)


@pytest.mark.process
@pytest.mark.parametrize("ending", SIGNAL_ENDINGS if FULL else ["SIGTERM", "SIGKILL"])
def test_the_next_merge_over_a_crash_with_every_ending(
    remerge: Scenario, crashes: dict[int, State], ending: str
) -> None:
    """The next merge over a crash state ended by a signal (in a child) at any of its operations."""
    _over_crashes(remerge, crashes, ending)


def test_the_next_merge_over_a_crash_with_a_full_disk(remerge: Scenario, crashes: dict[int, State]) -> None:
    """The next merge over a crash state with ENOSPC at any of its operations."""
    _over_crashes(remerge, crashes, "ENOSPC")


def test_a_file_system_without_hard_links_publishes(remerge: Scenario, crashes: dict[int, State]) -> None:
    """Issue 50, 9: where every link fails (EOPNOTSUPP, as on s3fs- or rclone-style mounts) a merge over a killed
    publish's marker still publishes its complete result: the publish makes no hard link."""
    crashed = next(operation for operation, state in crashes.items() if MARKER_FILE in (state or {}))
    out = _crashed(remerge, crashed, "no-links")
    original = os.link

    def no_links(*args: Any, **kwargs: Any) -> NoReturn:
        raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))

    os.link = no_links
    try:
        completed = drive(out, "new")
    finally:
        os.link = original
    assert completed.returncode == 0, completed.stderr[-2000:]
    after = snapshot(out) or {}
    assert published(after) == remerge.new and MARKER_FILE not in after


def test_the_marker_says_what_it_means(remerge: Scenario, crashes: dict[int, State]) -> None:
    marked = [state for state in crashes.values() if remerge.phase(state) == 1]
    assert marked and all((state or {})[MARKER_FILE] == MARKER_TEXT.encode() for state in marked)
    assert "Nothing completes that publish" in MARKER_TEXT


# Private staging (invariant 2) ---------------------------------------------------------------------


def test_a_second_merge_after_rm_rf_publishes_only_its_own(remerge: Scenario) -> None:
    """Merge 1 runs, the user removes OUT, merge 2 makes OUT anew: merge 1's writes fail and nothing of
    it reaches merge 2's folder (they never share a staging folder). Merge 2 runs while merge 1 waits."""
    out, second = remerge.make("rm-rf"), {}

    def meanwhile() -> None:
        shutil.rmtree(out)
        assert drive(out, "old").returncode == 0  # merge 2, 3 shards
        second.update(snapshot(out) or {})

    assert drive(out, "new", "pause", meanwhile=meanwhile).returncode != 0
    assert snapshot(out) == second and not left_over(second)
    assert sorted(name for name in second if name.startswith("model-")) == [
        f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)
    ]


@pytest.mark.parametrize("name", ["publish.json", MARKER_FILE, ".mergekit-ram-partial", "replaced"])
def test_an_output_folder_may_have_any_name(tmp_path, name: str) -> None:
    out = str(tmp_path / name)
    completed = drive(out, "new")
    assert completed.returncode == 0, completed.stderr
    state = snapshot(out) or {}
    assert state["config.json"] == b'{"gen": "new"}' and not left_over(state)


def test_an_earlier_designs_leftovers_are_reported_and_kept(remerge: Scenario) -> None:
    """The journal design's ``.mergekit-ram-partial`` (a killed run's: its journal and the folder's old
    config, card and weights) is neither completed, restored nor removed; the merge says so."""
    out = remerge.make("earlier-design")
    partial = os.path.join(out, ".mergekit-ram-partial")
    os.makedirs(os.path.join(partial, "old"))
    os.makedirs(os.path.join(partial, "out"))
    for name in ("config.json", "README.md", "model-00001-of-00003.safetensors"):
        shutil.copy2(os.path.join(out, name), os.path.join(partial, "old", name))
    with open(os.path.join(partial, "publish.json"), "w", encoding="utf-8") as handle:
        json.dump({"folder": "out", "stale": ["model-00001-of-00003.safetensors"]}, handle)
    kept = {name: data for name, data in (snapshot(out) or {}).items() if name.startswith(".mergekit-ram-partial")}
    failing = drive(out, "new", "fail")
    assert failing.returncode == 1 and ".mergekit-ram-partial" in failing.stderr
    assert LEFT_OVER_WARNING in failing.stderr
    merged = drive(out, "new")
    assert merged.returncode == 0 and LEFT_OVER_WARNING in merged.stderr
    after = snapshot(out) or {}
    assert published(after) == remerge.new
    assert {name: data for name, data in after.items() if name.startswith(".mergekit-ram-partial")} == kept


def test_removal_needs_the_recorded_size(remerge: Scenario) -> None:
    """Invariant 4: an earlier merge's weight goes only while its size is what that merge recorded (the manifest
    records names and sizes, so no weight is read twice), on whatever machine or copy: a copied folder, a shard
    touched or replaced, go; a shard that grew or shrank stays, named in one warning."""
    shard = "model-00003-of-00003.safetensors"
    out = remerge.make("identity")
    with open(os.path.join(out, MANIFEST_FILE), encoding="utf-8") as handle:
        recorded = json.load(handle)["weights"][shard]
    data = b"old model-00003-of-00003.safetensors\n"
    assert recorded == {"size": len(data)}
    copied = shutil.copytree(out, out + "-copy", symlinks=True)  # cp -a: other inodes, other mtimes
    touched = remerge.make("identity-touched")
    os.utime(os.path.join(touched, shard), ns=(0, 0))
    replaced = remerge.make("identity-replaced")
    os.unlink(os.path.join(replaced, shard))
    with open(os.path.join(replaced, shard), "wb") as handle:
        handle.write(data.upper())  # another file of the same size
    for folder in (out, copied, touched, replaced):
        completed = drive(folder, "new")
        assert completed.returncode == 0 and snapshot(folder) == remerge.new, (folder, completed.stderr[-2000:])
    grown = remerge.make("identity-grown")
    with open(os.path.join(grown, shard), "ab") as handle:
        handle.write(b"more")
    shrunk = remerge.make("identity-shrunk")
    os.truncate(os.path.join(shrunk, shard), 3)
    for folder in (grown, shrunk):
        with open(os.path.join(folder, shard), "rb") as handle:
            theirs = handle.read()
        completed = drive(folder, "new")
        assert completed.returncode == 0 and f"kept {shard} in {folder}" in completed.stderr
        assert published(snapshot(folder)) == {**(remerge.new or {}), shard: theirs}


def test_a_sticky_output_folder_is_refused_before_it_is_changed(tmp_path) -> None:
    """Threat model, other users: an OUT shared with the sticky bit (mode 1777, as /tmp) is refused in one line,
    nothing changed; a folder of one's own inside it merges."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    before = snapshot(str(shared))
    completed = drive(str(shared), "new")
    assert completed.returncode == 1 and completed.stderr.strip().splitlines()[-1] == (
        f"mergekit_ram.staging.OutputFolderError: {shared} is shared with the sticky bit (as /tmp is), where another "
        "user's file could stop the merge: merge into a folder of your own inside it"
    )
    assert snapshot(str(shared)) == before
    with pytest.raises(OutputFolderError, match="sticky bit"):
        replace_files(str(shared), REPLACED)
    assert drive(str(shared / "mine"), "new").returncode == 0 and os.path.isfile(shared / "mine" / "config.json")


# One writer (invariant 5) ------------------------------------------------------


def test_a_merge_whose_lock_was_removed_publishes_nothing(remerge: Scenario) -> None:
    """Invariant 5: the lock file removed while merge 1 runs (as ``rm -rf OUT/.*`` does, here without its private
    folder): merge 2 takes a new lock and publishes; merge 1 then publishes nothing and leaves merge 2's folder.
    Merge 2 runs while merge 1 waits (two open files of this process: ``flock`` tells them apart)."""
    out, second = remerge.make("lock-removed"), {}

    def meanwhile() -> None:
        os.unlink(os.path.join(out, LOCK_FILE))
        assert drive(out, "old").returncode == 0
        second.update(snapshot(out) or {})

    first = drive(out, "new", "pause", meanwhile=meanwhile)
    assert first.returncode == 1
    assert f"the lock file {os.path.join(out, LOCK_FILE)} was removed or replaced while this merge ran" in first.stderr
    assert snapshot(out) == published(second)  # less merge 1's private folder, which it removed
    assert "config.json" in second and second[MANIFEST_FILE] == published(remerge.old or {})[MANIFEST_FILE]


def test_a_lock_released_while_being_taken_is_taken_anew(remerge: Scenario) -> None:
    """Invariant 5, open then lock then check: merge B opens the lock file merge A holds; A ends, removing it, and
    C takes a new one. B, now able to lock the file it opened, finds the name naming C's file and is refused at
    once (without the check it would hold a lock nobody else sees, until its publish). A and C run in this
    thread, each waiting while the others act; B in another, held right after its second operation."""
    out = remerge.make("lock-race")
    held, release, ended = threading.Event(), threading.Event(), []

    def pause_b() -> None:  # the lock file opened, not yet locked
        held.set()
        assert release.wait(60), "B was never released"

    b = threading.Thread(target=lambda: ended.append(drive(out, "new")))

    def start_b() -> None:
        b.start()
        assert held.wait(60), "B never reached its second operation"

    def release_b() -> None:
        release.set()
        b.join(60)

    try:
        with faults.installed("fsop:any:2", pause_b, b):
            assert drive(out, "new", "pause", meanwhile=start_b).returncode == 0  # A
            third = drive(out, "old", "pause", meanwhile=release_b)  # C
    finally:  # none left waiting, whatever failed
        release.set()
        if b.is_alive():
            b.join(60)
    assert ended and ended[0].returncode == 1 and f"another merge is writing to {out}" in ended[0].stderr
    assert third.returncode == 0 and snapshot(out) == remerge.old


def test_the_card_tool_takes_the_merges_lock(remerge: Scenario) -> None:
    """``folder_writer`` (``check --set-license``): refused while a merge runs, and while a killed merge's marker
    or private folder is there; its lock file goes when it ends. In this process."""
    out = remerge.make("card-tool")
    with pytest.raises(OutputBusyError, match=f"another merge is writing to {re.escape(out)}"):
        with output_transaction(out):  # the refusal ends the merge too: nothing published
            with folder_writer(out):
                pass
    with folder_writer(out) as folder:
        assert os.path.samestat(os.fstat(folder), os.stat(out)) and LOCK_FILE in os.listdir(out)
    assert snapshot(out) == remerge.old and LOCK_FILE not in os.listdir(out)
    killed = _crashed(remerge, 30, "card-tool")  # a merge killed while publishing
    with pytest.raises(
        OutputFolderError, match=f"{re.escape(killed)} is marked {MARKER_FILE}: .* merge into it again before"
    ):
        with folder_writer(killed):
            pass


# Crafted states (invariant 3) ------------------------------------------------------------------------

#: What a stranger may write where the transaction reads a name: paths out of the folder, relative,
#: absolute and through a link, and values that are not names at all. "{outside}" is the victims' folder.
HOSTILE_NAMES = [
    "../outside/victim.safetensors",
    "{outside}/victim.safetensors",
    "evals/../../outside/victim.safetensors",
    "link-out.safetensors",  # a link in OUT to the victim: only the link may go
    "link-out-dir",
    "..",
    ".",
    "",
    "a/b.safetensors",
    "nul\0.safetensors",
]
#: Records that are not what the transaction records (its shard has 37 bytes).
HOSTILE_IDENTITIES: list[object] = [None, 7, "x", [37, "x"], {"size": "37"}, {"size": 37, "sha256": "0" * 64}]


def _manifest_naming(name: str) -> Callable[[str, str], None]:
    """A manifest whose weights name ``name`` with the size and SHA-256 of whatever OUT has under it, through
    a link too (so only the name, and never following it, decide)."""

    def make(out: str, outside: str) -> None:
        path = name.format(outside=outside)
        weights: dict[str, object] = {}
        with open(os.path.join(out, MANIFEST_FILE), "w", encoding="utf-8") as handle:
            try:
                with open(os.path.join(out, path), "rb") as target:
                    data = target.read()
                weights[path] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
            except (OSError, ValueError):
                weights[path] = {"size": 0, "sha256": hashlib.sha256(b"").hexdigest()}
            json.dump({"weights": weights}, handle)

    return make


def _json_file(path: str, data: object) -> Callable[[str, str], None]:
    def make(out: str, outside: str) -> None:
        os.makedirs(os.path.dirname(os.path.join(out, path)), exist_ok=True)
        with open(os.path.join(out, path), "w", encoding="utf-8") as handle:
            json.dump(data, handle)

    return make


def _as(path: str, kind: str) -> Callable[[str, str], None]:
    """The plugin's ``path`` (relative to OUT) made into something else: a link out, a FIFO, a folder, ..."""

    def make(out: str, outside: str) -> None:
        target = os.path.join(out, path)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if os.path.lexists(target):
            os.unlink(target)  # the earlier merge's file of that name
        if kind == "link to a file outside":
            os.symlink(os.path.join(outside, "victim.txt"), target)
        elif kind == "folder":
            os.makedirs(os.path.join(target, "inside"))
        elif kind == "oversized":
            with open(target, "wb") as handle:
                handle.truncate(65 << 20)  # sparse, above files.JSON_LIMIT
        elif kind == "not JSON":
            with open(target, "w", encoding="utf-8") as handle:
                handle.write("[" * 100_000)

    return make


def _crafted_states() -> dict[str, Callable[[str, str], None]]:
    states: dict[str, Callable[[str, str], None]] = {}
    for name in HOSTILE_NAMES:
        states[f"manifest weights {name!r}"] = _manifest_naming(name)
    shard = "model-00001-of-00003.safetensors"
    for identity in HOSTILE_IDENTITIES:
        states[f"manifest identity {identity!r}"] = _json_file(MANIFEST_FILE, {"weights": {shard: identity}})
    malformed = {
        "a list": [shard],
        "weights as a list": {"weights": [shard]},
        "weights as a string": {"weights": shard},
    }
    for label, data in malformed.items():
        states[f"manifest as {label}"] = _json_file(MANIFEST_FILE, data)
    for kind in ["link to a file outside", "folder", "oversized", "not JSON"]:
        states[f"{MANIFEST_FILE} as {kind}"] = _as(MANIFEST_FILE, kind)
    return states


CRAFTED = _crafted_states()


def _victims(root: str) -> str:
    outside = os.path.join(root, "outside")
    os.makedirs(os.path.join(outside, "victim-dir"))
    for name in ("victim.safetensors", "victim.txt", os.path.join("victim-dir", "kept.txt")):
        with open(os.path.join(outside, name), "w", encoding="utf-8") as handle:
            handle.write(f"the victim's {name}\n")
    return outside


def _crafted(scenario: Scenario, label: str, flags: tuple[str, ...]) -> None:
    """The crafted state ``label`` in a copy of the scenario's old folder, then the merge (a FIFO never waited on:
    ``hang_fails``)."""
    root = os.path.join(scenario.root, "crafted", f"{sorted(CRAFTED).index(label)}{'-'.join(flags)}")
    outside = _victims(root)
    out = os.path.join(root, "out")
    shutil.copytree(os.path.join(scenario.root, "old", "out"), out, symlinks=True)
    os.symlink(os.path.join(outside, "victim.safetensors"), os.path.join(out, "link-out.safetensors"))
    os.symlink(os.path.join(outside, "victim-dir"), os.path.join(out, "link-out-dir"))
    CRAFTED[label](out, outside)
    before, crafted = snapshot(outside), snapshot(out)
    with hang_fails(60):
        completed = drive(out, "new", *flags)
    assert snapshot(outside) == before, (label, flags)
    assert os.path.islink(os.path.join(out, "link-out-dir")), label  # a link to a folder is never removed
    if "fail" in flags:  # nothing acted on: the folder exactly as crafted
        assert snapshot(out) == crafted, label
    elif completed.returncode != 0:
        last = completed.stderr.strip().splitlines()[-1]
        assert last.startswith("mergekit_ram.staging.OutputFolderError: "), (label, completed.stderr[-3000:])
        assert "mergekit-ram's own name" in last or "Is a directory" in last, last
        assert snapshot(out) == crafted, label
    else:
        state = snapshot(out) or {}
        assert MARKER_FILE not in state and state["config.json"] == b'{"gen": "new"}', label
        mine = [name for name in left_over(state) if name not in left_over(crafted)]
        assert not mine, (label, mine)


@pytest.mark.parametrize("flags", [(), ("fail",)], ids=["merge", "failing merge"])
def test_crafted_states_never_reach_outside(remerge: Scenario, flags: tuple[str, ...]) -> None:
    """Invariants 1 and 3: whatever a stranger left under the plugin's names, nothing outside OUT changes;
    the merge completes or is refused in one line naming the plugin's name; a failing merge changes nothing."""
    assert len(CRAFTED) == len(HOSTILE_NAMES) + len(HOSTILE_IDENTITIES) + 3 + 4
    for label in sorted(CRAFTED):
        _crafted(remerge, label, flags)


# Files replaced outside a merge (``replace_files``: ``check --hub-id``), as a merge publishes -------------------

#: What ``replace_files`` writes over the remerge scenario's old folder: two files it holds, one it does not.
REPLACED = {"README.md": "# replaced\n", "tokenizer.json": "replaced tokenizer", "mergekit_config.yml": "recipe\n"}


@pytest.fixture(scope="module")
def replacing(remerge: Scenario) -> tuple[dict[str, bytes], dict[str, bytes], int]:
    """The old folder's files, the same after ``replace_files(REPLACED)``, and the number of its operations."""
    out = remerge.make("replace-count")
    with faults.counted(threading.current_thread()) as made:
        replace_files(out, REPLACED)
    new = snapshot(out) or {}
    assert published(new) == {**published(remerge.old), **{name: text.encode() for name, text in REPLACED.items()}}
    return published(remerge.old), new, len(made)


def _replace_faulted(out: str, operation: int, ending: str) -> subprocess.CompletedProcess:
    """``replace_files(out, REPLACED)``, ``ending`` at ``operation``: ENOSPC in this process, a signal in a child."""
    if ending != "ENOSPC":

        def replace() -> None:
            with faults.installed(f"fsop:any:{operation}:{ending}"):
                replace_files(out, REPLACED)

        return in_a_child(replace)
    with plugin_log(logging.WARNING, this_thread=True) as logged:
        try:
            with faults.installed(f"fsop:any:{operation}", "ENOSPC", threading.current_thread()):
                replace_files(out, REPLACED)
            code = 0
        except OutputFolderError as error:
            code, logged_error = 1, str(error)
            assert "no space left" in logged_error.lower(), logged_error
    return subprocess.CompletedProcess([], code, "", logged.getvalue())


def _after_a_faulted_replace(out: str, old: dict[str, bytes], new: dict[str, bytes], ending: str) -> None:
    """All old or all new (a marked mix only after SIGKILL); then the refusal's advice, followed, clears the way to
    the complete replacement."""
    state = snapshot(out) or {}
    files, left = published(state), left_over(state)
    assert files in (old, published(new)) or (ending == "SIGKILL" and MARKER_FILE in state), (ending, left)
    assert ending == "SIGKILL" or MARKER_FILE not in left
    for _ in range(3):  # each refusal names what clears it: merging again, or removing a folder
        try:
            replace_files(out, REPLACED)
            break
        except OutputFolderError as error:
            message = str(error)
            if MARKER_FILE in message:
                assert message.endswith("merge into it again before changing its files"), message
                assert drive(out, "old").returncode == 0
            else:
                named = re.findall(rf"{re.escape(out)}/\.mergekit-ram-[0-9a-f]{{16}}", message)
                assert named and "remove it" in message or "remove them" in message, message
                for path in named:
                    shutil.rmtree(path)
    after = snapshot(out) or {}
    assert not left_over(after) and all(after[name] == text.encode() for name, text in REPLACED.items())
    assert published(after) == published(new) or MARKER_FILE in state  # merged again: that merge's files


@pytest.mark.process
@pytest.mark.parametrize("ending", [*SIGNAL_ENDINGS, "ENOSPC"])
def test_replaced_files_are_all_old_or_all_new(remerge: Scenario, replacing: Any, ending: str) -> None:
    """``replace_files`` with ``ending`` at each of its operations: OUT all old or all new, then replaced whole."""
    old, new, count = replacing
    for operation in range(1, count + 1):
        out = remerge.make(f"replace-{ending}-{operation}")
        completed = _replace_faulted(out, operation, ending)
        assert ended_as_asked(completed, ending), (operation, completed.returncode, completed.stderr[-2000:])
        _after_a_faulted_replace(out, old, new, ending)


def test_replaced_files_wait_for_no_merge(remerge: Scenario) -> None:
    """``replace_files`` is refused while a merge holds OUT, and where a file changed since it was read."""
    out = remerge.make("replace-busy")
    before = snapshot(out)
    with pytest.raises(OutputBusyError, match=f"another merge is writing to {re.escape(out)}"):
        with output_transaction(out):
            replace_files(out, REPLACED)
    with open(os.path.join(out, "README.md"), encoding="utf-8") as handle:
        card = handle.read()
    with pytest.raises(OutputFolderError, match="README.md changed while this ran"):
        replace_files(out, REPLACED, expected={"README.md": card + "edited", "tokenizer.json": None})
    assert snapshot(out) == before
    replace_files(out, REPLACED, expected={"README.md": card, "mergekit_config.yml": None})
    assert published(snapshot(out)) == {**published(before), **{name: text.encode() for name, text in REPLACED.items()}}
