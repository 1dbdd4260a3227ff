"""The output transaction, enumerated: every file-system operation it makes, each way a process can
end there, and crafted folder states (the invariants are at the top of mergekit_ram/staging.py).

Each run is a real process running the real transaction (tests/faults/transaction.py stands in for
mergekit's writes, so a run takes tens of milliseconds); faults come from the seam in
tests/faults/sitecustomize.py, which counts the file-system calls staging.py makes and acts after
the N-th: a signal (every catchable signal whose default action ends a process, SIGINT, SIGKILL)
or a failed call (ENOSPC). ``make test`` runs a subset (every operation with SIGINT, SIGTERM,
SIGHUP, SIGKILL and ENOSPC; every signal at three operations; the recovery of two crash states);
the whole sweep (every signal at every operation of publishing and of each distinct recovery) is

    MERGEKIT_RAM_FULL_SWEEP=1 .venv/bin/python -m pytest tests/test_transaction.py -n 2
"""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import pytest

from mergekit_ram.staging import ENDING_SIGNALS, JOURNAL_FILE, MARKER_FILE, STAGING_DIR

FAULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "faults")
DRIVER = os.path.join(FAULTS, "transaction.py")
FULL = os.environ.get("MERGEKIT_RAM_FULL_SWEEP") == "1"
SIGNALS = [signal.Signals(number).name if number in signal.Signals._value2member_map_ else str(number)
           for number in ENDING_SIGNALS]  # fmt: skip
FAST_ENDINGS = ["SIGINT", "SIGTERM", "SIGHUP", "SIGKILL", "ENOSPC"]
ENDINGS = [*SIGNALS, "SIGKILL", "ENOSPC"] if FULL else FAST_ENDINGS
USER_FILES = {
    "notes.txt": b"my notes\n",
    "adapter_model.safetensors": b"not really an adapter",
    "pytorch_model_backup.bin": b"a backup",
    os.path.join("evals", "run.sh"): b"#!/bin/sh\n",
}
NOTES = "notes-written-during-the-merge.txt"  # the user's file in the "fresh" scenario
State = Optional[dict[str, bytes]]


def snapshot(folder: str) -> State:
    """Every entry under ``folder`` by relative path: a file's bytes, a link's target, b"<folder>"."""
    if not os.path.lexists(folder):
        return None
    found: dict[str, bytes] = {}
    for root, folders, files in os.walk(folder):
        for name in folders + files:
            path = os.path.join(root, name)
            if os.path.islink(path):
                found[os.path.relpath(path, folder)] = b"-> " + os.readlink(path).encode()
            elif os.path.isdir(path):
                found[os.path.relpath(path, folder)] = b"<folder>"
            else:
                with open(path, "rb") as handle:
                    found[os.path.relpath(path, folder)] = handle.read()
    return found


def drive(out: str, *arguments: str, fault: Optional[tuple[int, str]] = None, count: Optional[str] = None):
    """The driver in a new process: ``arguments`` are its GENERATION and flags."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("MERGEKIT_RAM_TEST_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [FAULTS, os.environ.get("PYTHONPATH")]))
    if fault is not None:
        env["MERGEKIT_RAM_TEST_FAULT"] = f"fsop:any:{fault[0]}:{fault[1]}"
    if count is not None:
        env["MERGEKIT_RAM_TEST_COUNT"] = count
    command = [sys.executable, DRIVER, out, *arguments]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)


def operations(out: str, *arguments: str) -> int:
    """How many file-system operations the transaction makes in this run (the run happens on ``out``)."""
    counted = out + ".count"
    completed = drive(out, *arguments, count=counted)
    assert completed.returncode in (0, 1), completed.stderr
    with open(counted, encoding="utf-8") as handle:
        return int(handle.read())


def in_parallel(work: Callable[..., object], cases: Sequence[tuple]) -> list:
    with concurrent.futures.ThreadPoolExecutor(max(2, os.cpu_count() or 2)) as pool:
        return list(pool.map(lambda case: work(*case), cases))


def left_over(state: State) -> list[str]:
    return sorted(name for name in state or {} if name.split(os.sep)[0] in (STAGING_DIR, MARKER_FILE))


def ended_as_asked(completed: subprocess.CompletedProcess, ending: str) -> bool:
    """The process ended as the fault says: by the signal (unless Python ignores it: it then
    finishes), or with an error for ENOSPC (unless the failed call was one the code expects to
    fail, such as a folder that exists: it then finishes)."""
    if ending == "ENOSPC":
        return completed.returncode in (0, 1)
    number = getattr(signal, ending, None) or int(ending)
    return completed.returncode in ((-number, 0) if ending in ("SIGPIPE", "SIGXFSZ") else (-number,))


@dataclass
class Scenario:
    """A folder before a merge, the same folder after the merge, and the operations between."""

    root: str
    old: State
    new: State
    count: int
    flags: tuple[str, ...] = ()

    def copy(self, name: str) -> str:
        out = os.path.join(self.root, name, "out")
        os.makedirs(os.path.dirname(out))
        if self.old is not None:
            shutil.copytree(os.path.join(self.root, "old", "out"), out, symlinks=True)
        return out

    def olds(self) -> list[State]:
        """What counts as the old state: a merge into a new folder may leave nothing, or the user's file."""
        return (
            [self.old]
            if self.old is not None
            else [None, {"notes-written-during-the-merge.txt": b"the user's notes\n"}]
        )


def _scenario(root: str, fresh: bool) -> Scenario:
    old_out = os.path.join(root, "old", "out")
    os.makedirs(os.path.dirname(old_out))
    if not fresh:
        assert drive(old_out, "old").returncode == 0
        for name, data in USER_FILES.items():
            os.makedirs(os.path.dirname(os.path.join(old_out, name)), exist_ok=True)
            with open(os.path.join(old_out, name), "wb") as handle:
                handle.write(data)
        os.symlink(os.path.join(root, "outside.txt"), os.path.join(old_out, "latest"))
    scenario = Scenario(root, snapshot(old_out), None, 0, ("user-file",) if fresh else ())
    new_out = scenario.copy("new")
    assert drive(new_out, "new", *scenario.flags).returncode == 0
    scenario.new = snapshot(new_out)
    scenario.count = operations(scenario.copy("count"), "new", *scenario.flags)
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
    assert fresh.new[NOTES] == b"the user's notes\n"
    assert remerge.count == 37 and fresh.count == 34  # the operations enumerated below


def _fault(scenario: Scenario, operation: int, ending: str, tag: str = "every") -> str:
    """Fault ``ending`` at ``operation``; the state after it (after the next merge's recovery where the
    process could not finish): "old" or "new"."""
    out = scenario.copy(f"{tag}-{ending}-{operation}")
    completed = drive(out, "new", *scenario.flags, fault=(operation, ending))
    assert ended_as_asked(completed, ending), (operation, ending, completed.returncode, completed.stderr[-2000:])
    state = snapshot(out)
    if left_over(state):
        assert ending in ("SIGKILL", "ENOSPC"), (operation, ending, left_over(state))
        journal = os.path.exists(os.path.join(out, STAGING_DIR, JOURNAL_FILE))
        marked = os.path.exists(os.path.join(out, MARKER_FILE))
        assert marked <= journal  # the marker only beside a journal
        published = {name: data for name, data in (state or {}).items() if name not in left_over(state)}
        if marked and published != scenario.new and published not in scenario.olds():  # half-published:
            # no loader may take it for a model
            assert "config.json" not in published, (operation, ending)
        completed = drive(out, "new", "fail")  # the next merge recovers, then fails before publishing
        state = snapshot(out)
        assert state == (scenario.new if journal else state) and not left_over(state), (operation, ending)
    if state == scenario.new:
        return "new"
    assert state in scenario.olds() or (ending == "SIGKILL" and state == {}), (operation, ending, state)
    return "old"


@pytest.mark.parametrize("ending", ENDINGS)
@pytest.mark.parametrize("name", ["remerge", "fresh"])
def test_every_operation_with_every_ending(name: str, ending: str, request: pytest.FixtureRequest) -> None:
    """Invariants 5 and 6: at every operation, the old state or the new merge, user files kept."""
    scenario: Scenario = request.getfixturevalue(name)
    outcomes = in_parallel(_fault, [(scenario, k, ending) for k in range(1, scenario.count + 1)])
    if ending in ("SIGPIPE", "SIGXFSZ"):  # Python ignores them (a failed write raises instead): the merge goes on
        assert set(outcomes) == {"new"}
    else:
        assert "old" in outcomes and "new" in outcomes  # a fault before publishing, and one after
    assert outcomes == sorted(outcomes, key=("old", "new").index), outcomes  # once new, new


@pytest.mark.skipif(FULL, reason="the full sweep runs every signal at every operation")
def test_every_signal_at_three_operations(remerge: Scenario) -> None:
    operations = (1, remerge.count // 2, remerge.count)
    cases = [(remerge, k, ending, "three") for k, ending in itertools.product(operations, SIGNALS)]
    assert set(in_parallel(_fault, cases)) == {"old", "new"}


def _crash_states(scenario: Scenario) -> dict[str, str]:
    """Each distinct folder a SIGKILL leaves (at every operation), as a copy: {path: "old" or "new",
    what a clean recovery makes of it (the next merge recovers, then fails before publishing)}."""
    found: dict[str, str] = {}
    seen: list[State] = []
    for operation in range(1, scenario.count + 1):
        out = scenario.copy(f"crash-{operation}")
        assert drive(out, "new", fault=(operation, "SIGKILL")).returncode == -signal.SIGKILL
        state = snapshot(out)
        if state in seen or not left_over(state):
            continue
        seen.append(state)
        recovered = shutil.copytree(out, out + "-recovered", symlinks=True)
        drive(recovered, "new", "fail")
        found[out] = "new" if snapshot(recovered) == scenario.new else "old"
        assert snapshot(recovered) == getattr(scenario, found[out]), operation
        journal = os.path.exists(os.path.join(out, STAGING_DIR, JOURNAL_FILE))
        assert journal <= (found[out] == "new")  # a journal is always completed
    return found


def _recovery_fault(scenario: Scenario, crashed: str, expected: str, operation: int, ending: str) -> None:
    out = os.path.join(os.path.dirname(crashed) + f"-{ending}-{operation}", "out")
    shutil.copytree(crashed, out, symlinks=True)
    completed = drive(out, "new", "fail", fault=(operation, ending))
    assert ended_as_asked(completed, ending) or completed.returncode == 1, (operation, ending, completed.stderr)
    if left_over(snapshot(out)):
        drive(out, "new", "fail")
    assert snapshot(out) == getattr(scenario, expected), (crashed, operation, ending)


def test_recovery_with_every_ending(remerge: Scenario) -> None:
    """Invariant 6: a fault at any operation of the next merge's recovery still converges (the
    subset: two crash states in the middle of publishing, with SIGTERM, SIGKILL and ENOSPC)."""
    crashes = _crash_states(remerge)
    assert set(crashes.values()) == {"old", "new"} and len(crashes) >= 10
    chosen = list(crashes.items()) if FULL else [item for item in crashes.items() if item[1] == "new"][1:3]
    endings = ENDINGS if FULL else ["SIGTERM", "SIGKILL", "ENOSPC"]
    cases = []
    for crashed, expected in chosen:
        count = operations(shutil.copytree(crashed, crashed + "-count", symlinks=True), "new", "fail")
        cases += [(remerge, crashed, expected, k, e) for k in range(1, count + 1) for e in endings]
    in_parallel(_recovery_fault, cases)


# Crafted states (invariants 1 and 2) -------------------------------------------------------------

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
    7,
    None,
    ["model-00001-of-00003.safetensors"],
    {"nested": "x"},
]


def _with_names(path: str, key: str, names: list[object]) -> Callable[[str, str], None]:
    """A crafted JSON file at ``path`` (relative to OUT) whose ``key`` lists ``names``."""

    def make(out: str, outside: str) -> None:
        values = [name.format(outside=outside) if isinstance(name, str) else name for name in names]
        data: dict[str, object]
        if key == "weight_map":
            data = {"metadata": {"mergekit_version": "0.1.5"}, "weight_map": {f"t{i}": v for i, v in enumerate(values)}}
        elif key == "folder":
            data = {"folder": values[0], "stale": []}
        else:
            data = {key: values, "folder": "out"} if key == "stale" else {key: values}
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
        elif kind == "link to a folder outside":
            os.symlink(os.path.join(outside, "victim-dir"), target)
        elif kind == "fifo":
            os.mkfifo(target)
        elif kind == "folder":
            os.makedirs(os.path.join(target, "inside"))
        elif kind == "oversized":
            with open(target, "wb") as handle:
                handle.truncate(65 << 20)  # sparse, above files.JSON_LIMIT
        elif kind == "not JSON":
            with open(target, "w", encoding="utf-8") as handle:
                handle.write("[" * 100_000)

    return make


#: Plugin files whose JSON has the wrong shape: every field of the wrong type.
_MALFORMED = [
    ("journal as a list", (STAGING_DIR, JOURNAL_FILE), ["out", []]),
    (
        "journal stale as a string",
        (STAGING_DIR, JOURNAL_FILE),
        {"folder": "out", "stale": "model-00001-of-00003.safetensors"},
    ),
    ("journal folder as a list", (STAGING_DIR, JOURNAL_FILE), {"folder": ["out"], "stale": []}),
    ("manifest weights as a string", (".mergekit-ram-manifest.json",), {"weights": "model.safetensors"}),
    ("manifest as a list", (".mergekit-ram-manifest.json",), ["model-00001-of-00003.safetensors"]),
    (
        "index metadata as a string",
        ("model.safetensors.index.json",),
        {"metadata": "mergekit_version", "weight_map": "ab"},
    ),
    (
        "index weight_map as a list",
        ("model.safetensors.index.json",),
        {"metadata": {"mergekit_version": 1}, "weight_map": [["t", "x"]]},
    ),
]


def _json_file(path: str, data: object) -> Callable[[str, str], None]:
    def make(out: str, outside: str) -> None:
        os.makedirs(os.path.dirname(os.path.join(out, path)), exist_ok=True)
        with open(os.path.join(out, path), "w", encoding="utf-8") as handle:
            json.dump(data, handle)

    return make


def _crafted_states() -> dict[str, Callable[[str, str], None]]:
    journal = os.path.join(STAGING_DIR, JOURNAL_FILE)
    states: dict[str, Callable[[str, str], None]] = {}
    for name in HOSTILE_NAMES:
        label = repr(name)
        states[f"journal folder {label}"] = _with_names(journal, "folder", [name])
        states[f"journal stale {label}"] = _with_names(journal, "stale", [name])
        states[f"manifest weights {label}"] = _with_names(".mergekit-ram-manifest.json", "weights", [name])
        states[f"index weight_map {label}"] = _with_names("model.safetensors.index.json", "weight_map", [name])
    for label, path, data in _MALFORMED:
        states[label] = _json_file(os.path.join(*path), data)
    kinds = ["link to a file outside", "link to a folder outside", "fifo", "folder", "oversized", "not JSON"]
    for path in [journal, ".mergekit-ram-manifest.json", "model.safetensors.index.json", MARKER_FILE]:
        for kind in kinds:
            states[f"{path} as {kind}"] = _as(path, kind)
    for path in [STAGING_DIR, os.path.join(STAGING_DIR, "out"), os.path.join(STAGING_DIR, "out", "config.json")]:
        for kind in ["link to a file outside", "link to a folder outside", "fifo"]:
            states[f"{path} as {kind}"] = _as(path, kind)
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
    root = os.path.join(scenario.root, "crafted", f"{sorted(CRAFTED).index(label)}{'-'.join(flags)}")
    outside = _victims(root)
    out = os.path.join(root, "out")
    shutil.copytree(os.path.join(scenario.root, "old", "out"), out, symlinks=True)
    os.symlink(os.path.join(outside, "victim.safetensors"), os.path.join(out, "link-out.safetensors"))
    os.symlink(os.path.join(outside, "victim-dir"), os.path.join(out, "link-out-dir"))
    CRAFTED[label](out, outside)
    before = snapshot(outside)
    completed = drive(out, "new", *flags)
    assert snapshot(outside) == before, (label, flags)
    assert os.path.islink(os.path.join(out, "link-out-dir")), label  # a link to a folder is never removed
    if completed.returncode != 0 and "fail" not in flags:
        last = completed.stderr.strip().splitlines()[-1]
        assert last.startswith("mergekit_ram.staging.OutputFolderError: "), (label, completed.stderr[-3000:])
        assert "mergekit-ram's own name" in last or "it is marked MERGE_INCOMPLETE: fix that" in last, last
    elif "fail" not in flags:
        state = snapshot(out) or {}
        assert not left_over(state) and state["config.json"] == b'{"gen": "new"}', label


@pytest.mark.parametrize("flags", [(), ("fail",)], ids=["merge", "recovery only"])
def test_crafted_states_never_reach_outside(remerge: Scenario, flags: tuple[str, ...]) -> None:
    """Invariants 1 and 2: whatever a stranger left under the plugin's names, nothing outside OUT
    changes, and the merge completes or is refused in one line naming the plugin's name."""
    assert len(CRAFTED) == 4 * len(HOSTILE_NAMES) + len(_MALFORMED) + 4 * 6 + 3 * 3
    in_parallel(_crafted, [(remerge, label, flags) for label in sorted(CRAFTED)])
