"""A RAM merge never destroys data: the output transaction, the lock, protected inputs, through the
real console scripts (tests/test_transaction.py enumerates every operation of the transaction itself).

Faults come from ``tests/faults/sitecustomize.py`` (the library has no test hooks): a signal or a full
disk at a named moment, and each outcome is compared byte for byte with the folder before the merge
("old") and with the same merge run without a fault ("new"). The console scripts run in this process
(``run_script``) where the fault is Ctrl-C (its KeyboardInterrupt), a full disk, a second merge while the
first is held at a kernel call, or what a SIGKILL leaves (the folder copied right after that operation:
tests/test_transaction.py's sweep checks a real kill leaves exactly that); a signal that ends the process,
and a SIGKILL while mergekit writes, end a console script started afresh (tests marked ``process``).
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import pytest
import yaml
from mergekit.config import MergeConfiguration
from mergekit.merge import run_merge
from mergekit.options import MergeOptions
from mergekit.scripts.merge_raw_pytorch import main as mergekit_pytorch

from mergekit_ram.errors import InputError
from mergekit_ram.staging import LOCK_FILE, MANIFEST_FILE, MARKER_FILE, MARKER_TEXT, PRIVATE_PREFIX
from mergekit_ram.synthetic import build_agents, tiny_config
from tests.conftest import (
    ModelSet,
    command_refusal,
    merge_in_process,
    plugin_log,
    run_process,
    run_script,
    script,
    write_recipe,
)
from tests.faults import sitecustomize as faults
from tests.test_prepass import save_tokenizer

FAULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "faults")
USER_FILES = {
    "notes.txt": b"my notes\n",
    "adapter_model.safetensors": b"not really an adapter",
    "my_embeddings.safetensors": b"user embeddings",
    "pytorch_model_backup.bin": b"a backup",
    "adapter_config.json": b"{}\n",
}
#: Operations of the transaction re-merging the world's folder, by name (``fsop:OPERATION:N``, tests/faults): the
#: last of preparing, the manifest written (signals not held), the marker written, config.json leaving, an old shard
#: leaving, the new weights coming in.
LAST_OF_BEGIN, RECORDING, MARKER_WRITTEN = "mkdir staged/out:1", f"open {MANIFEST_FILE}:1", f"open {MARKER_FILE}:1"
CONFIG_LEAVES, OLD_SHARDS, NEW_FILES = (
    "rename config.json:1",
    "rename model-00003-of-00007.safetensors:1",
    ("rename model.safetensors:1"),
)


def snapshot(folder: str) -> dict[str, bytes]:
    """Every file under ``folder`` (hidden ones too), by relative path.

    mergekit's card lists the models in the order of a set of ModelReference, whose hash
    includes its class's id: ``README.md`` counts as its lines, in sorted order.
    """
    found = {}
    for root, _dirs, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as handle:
                data = handle.read()
            if name == "README.md":
                data = b"\n".join(sorted(data.split(b"\n")))
            found[os.path.relpath(path, folder)] = data
    return found


def faulted(name: str, *args: str, fault: Optional[str] = None) -> subprocess.CompletedProcess:
    """The console script ``name`` in a new interpreter with the fault hook (``fault``: tests/faults)."""
    return run_process([script(name), *args], fault_env(fault))


@contextlib.contextmanager
def faulted_here(fault: str, action: Optional[Callable[[], None]] = None) -> Iterator[None]:
    """The fault ``fault`` (``WHERE:WHAT:N:ACTION``, or ``WHERE:WHAT:N`` and ``action``) in this process meanwhile:
    ENOSPC, or SIGINT, sent to this process, which raises KeyboardInterrupt (Python's own handler set meanwhile,
    whatever the test run inherited). A KeyboardInterrupt that reaches the test fails it."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with faults.installed(fault, action):
            yield
    except KeyboardInterrupt:
        raise AssertionError(f"{fault}: the Ctrl-C reached the test; the merge did not take it") from None
    finally:
        signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def meanwhile(fault: str, work: Callable[[], None]) -> Iterator[None]:
    """``work()`` at ``fault``'s point (``WHERE:WHAT:N``), the merge waiting meanwhile; what it raises is raised
    when the block ends, not taken by the merge for its own failure."""
    done: list[Optional[BaseException]] = []

    def act() -> None:
        try:
            work()
            done.append(None)
        except BaseException as error:
            done.append(error)

    with faults.installed(fault, act):
        yield
    assert done, f"the merge never reached {fault}"
    if done[0] is not None:
        raise done[0]


def killed_at(folder: str, into: str) -> Callable[[], None]:
    """The action that copies ``folder`` into ``into`` (links as links, modes kept): run right after one of the
    transaction's operations, what a SIGKILL there leaves (tests/test_transaction.py checks that a real kill
    leaves that copy, at every operation)."""

    def copy() -> None:
        shutil.copytree(folder, into, symlinks=True)

    return copy


def fault_env(fault: Optional[str] = None, **extra: str) -> dict[str, str]:
    """The fault hook on PYTHONPATH (it does nothing without a fault), with every ignored signal set back
    to its default action (a shell's background job, ``make test &``, starts with SIGINT and SIGQUIT ignored)."""
    env = {
        "PYTHONPATH": os.pathsep.join(filter(None, [FAULTS, os.environ.get("PYTHONPATH")])),
        "MERGEKIT_RAM_TEST_SIGNALS": "default",
        **extra,
    }
    if fault:
        env["MERGEKIT_RAM_TEST_FAULT"] = fault
    return env


class World:
    """Models with a tokenizer, an earlier sharded `ram` merge beside user files, the new merge."""

    def __init__(self, root: str, models: ModelSet) -> None:
        self.root = root
        base = shutil.copytree(models.base, os.path.join(root, "base"))
        save_tokenizer(base, ["<unk>"] + [f"t{i}" for i in range(1, 64)])
        self.models = ModelSet(base=base, agents=models.agents, design=models.design)
        self.old_recipe = write_recipe(os.path.join(root, "old.yml"), self.models.recipe("ram"))
        self.new_recipe = write_recipe(os.path.join(root, "new.yml"), self.models.recipe("ram_plus"))
        # Both set-up merges run in this process, as mergekit-yaml would run them (the fault cases
        # below compare the console script's folders with them byte for byte).
        self.template = os.path.join(root, "template", "out")
        merge_in_process(self.old_recipe, self.template, out_shard_size=8000)
        for user_file, data in USER_FILES.items():
            with open(os.path.join(self.template, user_file), "wb") as handle:
                handle.write(data)
        self.old = snapshot(self.template)
        reference = self.make_old("reference")
        with plugin_log() as log:
            merge_in_process(self.new_recipe, reference)
        self.log = log.getvalue()
        self.new = snapshot(reference)

    def make_old(self, name: str) -> str:
        """A folder in the old state: a copy of the earlier merge and the user's files beside it (its manifest
        records each weight's size and SHA-256, which a copy keeps: it replaces them as it would the original)."""
        out = os.path.join(self.root, name, "out")
        shutil.copytree(self.template, out, symlinks=True)
        return out


@pytest.fixture(scope="module")
def world(bf16_models: ModelSet, tmp_path_factory: pytest.TempPathFactory) -> World:
    return World(str(tmp_path_factory.mktemp("output")), bf16_models)


def test_a_merge_replaces_only_what_merges_wrote(world: World) -> None:
    """Case 1: user files survive, weight-like or not; the earlier merge's shards are replaced."""
    old_shards = sorted(name for name in world.old if name.startswith("model-0"))
    assert len(old_shards) == 7 and "model.safetensors.index.json" in world.old  # 8K shards of the tiny model
    for name, data in USER_FILES.items():
        assert world.new[name] == data
    assert not [name for name in world.new if name.startswith("model-0")]
    assert "model.safetensors.index.json" not in world.new
    assert {"model.safetensors", "config.json", "tokenizer.json", "README.md", "ram_statistics.json"} <= set(world.new)
    assert MARKER_FILE not in world.new
    assert not [name for name in world.new if name.startswith(PRIVATE_PREFIX) and name != MANIFEST_FILE]
    manifest, weights = json.loads(world.new[MANIFEST_FILE]), world.new["model.safetensors"]
    assert manifest["weights"] == {"model.safetensors": {"size": len(weights)}}
    assert "tokenizer.json" in manifest["files"]
    assert "removed model-00001-of-" in world.log and "model.safetensors.index.json" in world.log
    with open(os.path.join(world.root, "reference", "out", "README.md"), encoding="utf-8") as handle:
        card = handle.read()
    assert card.startswith("---") and "\n# out\n" in card and "## RAM statistics" in card


FAULT_CASES = [
    # (fault, outcome): "old" = byte for byte the folder before, "new" = the complete new merge; SIGINT and ENOSPC
    # in this process, the signals that end a process in one (IN_THIS_PROCESS)
    ("kernel:prepass:3:SIGINT", "old"),
    ("kernel:merge:5:SIGTERM", "old"),
    ("kernel:merge:2:SIGHUP", "old"),  # an ssh disconnect
    ("open:config.json:1:SIGINT", "old"),  # mergekit wrote the new config (case 5)
    ("open:tokenizer.json:1:SIGUSR1", "old"),
    ("open:README.md:1:ENOSPC", "old"),  # disk full while the card is written (case 5)
    (f"fsop:{LAST_OF_BEGIN}:SIGTERM", "old"),  # held while the folder is prepared, then acted on
    (f"fsop:{RECORDING}:SIGINT", "old"),  # while the manifest is written: not held
    (f"fsop:{CONFIG_LEAVES}:SIGINT", "new"),  # signals are held while publishing (case 6)
    (f"fsop:{OLD_SHARDS}:SIGQUIT", "new"),
    (f"fsop:{NEW_FILES}:SIGHUP", "new"),
    (f"fsop:{NEW_FILES}:SIGUSR1", "new"),
]


#: The actions a merge in this process takes as it takes them in its own: Ctrl-C and a full disk.
IN_THIS_PROCESS = ("SIGINT", "ENOSPC")


def _left_as_said(world: World, out: str, fault: str, outcome: str, completed: subprocess.CompletedProcess) -> None:
    """The run ended as the fault says (Ctrl-C: one line saying what ``out`` holds, 130; ENOSPC: one line; a
    signal: by it), and ``out`` holds ``outcome``."""
    assert completed.returncode != 0, "the fault did not fire"
    action = fault.rsplit(":", 1)[1]
    if action == "SIGINT":
        holds = "holds what it held before" if outcome == "old" else "holds the complete new merge"
        last = completed.stderr.strip().splitlines()[-1]
        assert completed.returncode == 130 and holds in last and out in last, completed.stderr[-3000:]
        assert "Aborted!" not in completed.stderr and "Traceback" not in completed.stderr, completed.stderr[-3000:]
    elif action == "ENOSPC":
        assert completed.stderr.strip().splitlines()[-1].startswith("Error: no space left on the device (errno ENOSPC)")
    else:
        assert completed.returncode == -getattr(signal, action), completed.stderr[-3000:]
    expected = world.old if outcome == "old" else world.new
    assert snapshot(out) == expected, completed.stderr[-3000:]


HERE = [(fault, outcome) for fault, outcome in FAULT_CASES if fault.rsplit(":", 1)[1] in IN_THIS_PROCESS]


@pytest.mark.parametrize(("fault", "outcome"), HERE, ids=[fault for fault, _ in HERE])
def test_ctrl_c_or_a_full_disk_leaves_the_old_folder_or_the_complete_new_merge(
    world: World, fault: str, outcome: str
) -> None:
    """mergekit-yaml in this process, Ctrl-C (SIGINT sent to it) or ENOSPC at the fault."""
    out = world.make_old(fault.replace(":", "-").replace("/", "-"))
    with faulted_here(fault):
        completed = run_script("mergekit-yaml", world.new_recipe, out, check=False)
    _left_as_said(world, out, fault, outcome, completed)


def _signalled(fault: str, outcome: str) -> Callable[[World, Path], None]:
    def case(world: World, _tmp_path: Path) -> None:
        out = world.make_old(fault.replace(":", "-").replace("/", "-"))
        _left_as_said(world, out, fault, outcome, faulted("mergekit-yaml", world.new_recipe, out, fault=fault))

    return case


def _the_folders_a_merge_made_go(world: World, tmp_path: Path) -> None:
    """Without the user's notes (``test_a_user_file_in_a_folder_the_merge_created_survives_ctrl_c``), every
    folder the merge made goes, SIGTERM too."""
    empty = str(tmp_path / "empty" / "a" / "out")
    failed = faulted("mergekit-yaml", world.new_recipe, empty, fault="kernel:merge:2:SIGTERM")
    assert failed.returncode == -signal.SIGTERM and not os.path.exists(str(tmp_path / "empty"))


def _killed_while_mergekit_writes(_world: World, tmp_path: Path) -> None:
    """Kill mergekit-yaml while it writes shards: no weights, no config in the output folder; the next merge
    takes over the killed run's lock, reports its folder and leaves it as it was."""
    config = tiny_config("llama", hidden_size=256, intermediate_size=768, num_layers=6, vocab_size=4096)
    base, agents, _ = build_agents(str(tmp_path / "models"), config, {(0,): 0.1, (1,): 0.1, (0, 1): 0.1}, ["a", "b"])
    recipe = write_recipe(
        str(tmp_path / "r.yml"),
        {"merge_method": "ram_plus", "base_model": base, "models": [{"model": p} for p in agents]},
    )
    out = tmp_path / "out"
    process = subprocess.Popen(
        [script("mergekit-yaml"), recipe, str(out), "--out-shard-size", "200K"],
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    staged: list[str] = []
    while time.monotonic() < deadline and process.poll() is None:
        staged = glob.glob(str(out / (PRIVATE_PREFIX + "*") / "staged" / "out"))  # the transaction's private folder
        if staged and len(os.listdir(staged[0])) >= 2:
            break
        time.sleep(0.005)
    assert process.poll() is None, "the merge finished before it could be interrupted"
    process.send_signal(signal.SIGKILL)
    process.wait()
    private = os.path.dirname(os.path.dirname(staged[0]))
    # nothing but the hidden private folder and the lock file (empty: the next merge takes it over)
    assert sorted(os.listdir(out)) == sorted([os.path.basename(private), LOCK_FILE])
    kept = sorted(glob.glob(os.path.join(staged[0], "*.safetensors")))
    assert kept  # the partial shards are there
    merge_in_process(recipe, str(out))  # the killed run's lock died with it; its folder is reported, not used
    left = sorted(os.listdir(out))
    assert MARKER_FILE not in left and LOCK_FILE not in left and "config.json" in left
    assert os.path.basename(private) in left
    assert sorted(glob.glob(os.path.join(staged[0], "*.safetensors"))) == kept


#: A console script started afresh, ended by a signal: FAULT_CASES' signals that end a process, and two more.
ENDED = {fault: _signalled(fault, outcome) for fault, outcome in FAULT_CASES if (fault, outcome) not in HERE}
ENDED["kernel:merge:2:SIGTERM into folders it made"] = _the_folders_a_merge_made_go
ENDED["SIGKILL while mergekit writes shards"] = _killed_while_mergekit_writes


@pytest.mark.process
@pytest.mark.parametrize("case", list(ENDED))
def test_a_fault_leaves_the_old_folder_or_the_complete_new_merge(world: World, tmp_path: Path, case: str) -> None:
    """A signal that ends mergekit-yaml at the fault: the old folder or the complete new merge."""
    ENDED[case](world, tmp_path)


def test_a_killed_publish_is_marked_and_never_replayed(world: World) -> None:
    """SIGKILL in the middle of publishing: marked, not loadable. Then a merge with mergekit's own
    ``linear`` and a RAM merge that fails: nothing of the killed merge comes back over the linear one.
    A failed rename instead: undone at once by the same process."""
    out = world.make_old("killed-ENOSPC")
    with faulted_here(f"fsop:{OLD_SHARDS}:ENOSPC"):
        failed = run_script("mergekit-yaml", world.new_recipe, out, check=False)
    assert failed.returncode == 1 and "it holds what it held before" in failed.stderr
    assert snapshot(out) == world.old
    scratch, out = world.make_old("killed-scratch"), os.path.join(world.root, "killed-SIGKILL", "out")
    with faults.installed(f"fsop:{OLD_SHARDS}", killed_at(scratch, out)):
        run_script("mergekit-yaml", world.new_recipe, scratch)
    left = os.listdir(out)
    assert MARKER_FILE in left and "config.json" not in left  # neither transformers nor --lazy takes it
    with open(os.path.join(out, MARKER_FILE), encoding="utf-8") as handle:
        assert handle.read() == MARKER_TEXT  # it says what it means and what to do
    merge_in_process(world.models.recipe("linear", parameters={"weight": 1.0}), out)
    linear = snapshot(out)
    del linear[LOCK_FILE]  # the killed merge's, taken over and removed by the next RAM merge (it holds nothing)
    with faulted_here("kernel:merge:1:ENOSPC"):  # a RAM merge that fails in its own merge
        refused = run_script("mergekit-yaml", world.new_recipe, out, check=False)
    assert refused.returncode != 0 and "did not finish" in refused.stderr
    assert snapshot(out) == linear
    merge_in_process(world.new_recipe, out)  # a clean rerun writes its own complete result
    merged = snapshot(out)
    private = [name for name in merged if name.startswith(PRIVATE_PREFIX) and name != MANIFEST_FILE]
    assert {name: data for name, data in merged.items() if name not in private} == world.new
    assert private and all(merged[name] == linear[name] for name in private)  # the killed run's folder, as it was


def test_a_user_file_in_a_folder_the_merge_created_survives_ctrl_c(world: World, tmp_path) -> None:
    """Case 2 of the safety issue: the merge made the folder, the user saved notes into it meanwhile, then
    Ctrl-C: the notes stay (the folder is removed only when empty), and nothing else of the merge does."""
    out = str(tmp_path / "made-by-the-merge" / "out")

    def notes_then_ctrl_c() -> None:
        with open(os.path.join(out, "notes.txt"), "w", encoding="utf-8") as handle:
            handle.write("my notes\n")
        os.kill(os.getpid(), signal.SIGINT)

    with faulted_here("kernel:merge:2", notes_then_ctrl_c):
        merge = run_script("mergekit-yaml", world.new_recipe, out, check=False)
    assert merge.returncode == 130, merge.stderr[-3000:]
    assert snapshot(out) == {"notes.txt": b"my notes\n"}


def test_a_second_merge_into_a_busy_folder_is_refused_at_once(world: World) -> None:
    """Case 4: one merge per output folder, by an OS lock. The second runs while the first waits at a kernel
    call (``flock`` tells two open files of one process apart)."""
    out, seen = world.make_old("busy"), {}

    def second_merge() -> None:
        during = snapshot(out)
        second = run_script("mergekit-yaml", world.old_recipe, out, check=False)
        assert second.returncode != 0
        assert f"another merge is writing to {out}" in second.stderr
        assert snapshot(out) == during
        seen["second"] = second

    with meanwhile("kernel:merge:2", second_merge):
        first = run_script("mergekit-yaml", world.new_recipe, out, check=False)
    assert seen and first.returncode == 0, first.stderr[-3000:]
    assert snapshot(out) == world.new


def test_one_writer_whatever_removes_the_lock(world: World, tmp_path) -> None:
    """Case 3: ``rm -rf OUT/.*`` (or ``git clean -fdx``) removes a running merge's lock file and its private
    folder, so a second merge may run and publish: the first then publishes nothing over it. After ``rm -rf
    OUT`` a third merge makes a new OUT, and the first merge's failure leaves that alone too. The others run
    while the first waits at a kernel call."""
    out, seen = str(tmp_path / "made-by-the-first" / "out"), {}

    def the_others() -> None:
        assert LOCK_FILE in os.listdir(out)
        for name in os.listdir(out):  # rm -rf out/.*
            if os.path.isdir(os.path.join(out, name)):
                shutil.rmtree(os.path.join(out, name))
            else:
                os.unlink(os.path.join(out, name))
        merge_in_process(world.new_recipe, out)
        second = snapshot(out)
        assert "config.json" in second and LOCK_FILE not in second
        shutil.rmtree(out)  # rm -rf out
        merge_in_process(world.old_recipe, out)
        seen["third"] = snapshot(out)

    with meanwhile("kernel:merge:2", the_others):
        first = run_script("mergekit-yaml", world.new_recipe, out, check=False)
    assert first.returncode != 0
    assert snapshot(out) == seen["third"] and "config.json" in seen["third"]


def _spellings(folder: str, root: str) -> list[str]:
    link = os.path.join(root, "link-to-" + os.path.basename(folder))
    if not os.path.lexists(link):
        os.symlink(folder, link)
    parent, name = os.path.split(folder)
    return [folder, folder + "/", os.path.join(parent, "..", os.path.basename(parent), name), link, link + "/"]


def test_an_input_folder_is_refused_however_spelled(world: World, tmp_path) -> None:
    """Case 3: the base's or a fine-tune's folder as the output, refused before anything is read."""
    before = {path: snapshot(path) for path in [world.models.base, world.models.agents[1]]}
    config = MergeConfiguration.model_validate(world.models.recipe("ram_plus"))
    for folder, label in ((world.models.base, world.models.base), (world.models.agents[1], world.models.agents[1])):
        for spelling in _spellings(folder, str(tmp_path)):
            with pytest.raises(InputError, match="is the folder of the input") as raised:
                run_merge(config, spelling, options=MergeOptions(quiet=True))
            assert label in str(raised.value) and spelling in str(raised.value)
    assert {path: snapshot(path) for path in before} == before


def _pytorch_recipe(models: ModelSet, root: str, method: str = "ram_plus") -> str:
    recipe: dict[str, Any] = {
        "merge_method": method,
        "base_model": os.path.join(models.base, "model.safetensors"),
        "models": [{"model": os.path.join(path, "model.safetensors")} for path in models.agents],
    }
    return write_recipe(os.path.join(root, f"pytorch-{method}.yml"), recipe)


def test_mergekit_pytorch_refuses_an_input_folder_and_publishes_all_or_nothing(world: World, tmp_path) -> None:
    """Case 2, and the same transaction under mergekit-pytorch."""
    recipe = _pytorch_recipe(world.models, str(tmp_path))
    agent = world.models.agents[0]
    before = snapshot(agent)
    link = _spellings(agent, str(tmp_path))[3] + "/"
    refusal = command_refusal(mergekit_pytorch, recipe, link)  # the real command, in-process
    assert f"is the folder of the input {os.path.join(agent, 'model.safetensors')}" in refusal
    assert snapshot(agent) == before

    out = world.make_old("pytorch")
    with faulted_here(f"fsop:{MARKER_WRITTEN}:ENOSPC"):  # the disk is full when the marker is written
        failed = run_script("mergekit-pytorch", recipe, out, check=False)  # nothing moved yet
    assert "could not publish into" in failed.stderr and "it holds what it held before" in failed.stderr
    assert failed.returncode != 0 and snapshot(out) == world.old
    mergekit_pytorch.main(args=[recipe, out], standalone_mode=False)
    merged = snapshot(out)
    assert {name: merged[name] for name in USER_FILES} == USER_FILES
    assert merged["config.json"] == world.old["config.json"]  # mergekit-pytorch writes no config
    assert not [name for name in merged if name.startswith("model-0")] and MARKER_FILE not in merged


def test_mergekit_multi_lazy_reruns_a_stage_killed_while_publishing(world: World, tmp_path) -> None:
    """A stage killed mid-publish has no config.json, so --lazy merges it again instead of skipping it."""
    stages = tmp_path / "stages"
    recipe = dict(yaml.safe_load(open(world.new_recipe, encoding="utf-8")), name="stage")
    config = str(tmp_path / "multi.yml")
    with open(config, "w", encoding="utf-8") as handle:
        yaml.safe_dump(recipe, handle, sort_keys=False)
    scratch = tmp_path / "scratch"  # the stage killed where it runs, copied into stages/stage
    killed = killed_at(str(scratch / "stage"), str(stages / "stage"))  # the marker in, config.json not yet
    with faults.installed(f"fsop:rename {MANIFEST_FILE}:1", killed):
        run_script("mergekit-multi", config, "-I", str(scratch))
    assert MARKER_FILE in os.listdir(stages / "stage") and "config.json" not in os.listdir(stages / "stage")
    private = [
        name for name in os.listdir(stages / "stage") if name.startswith(PRIVATE_PREFIX) and name != MANIFEST_FILE
    ]
    rerun = run_script("mergekit-multi", config, "-I", str(stages), "--lazy", "-v")
    assert "already exists" not in rerun.stderr and "did not finish" in rerun.stderr
    left = os.listdir(stages / "stage")
    assert MARKER_FILE not in left and "config.json" in left
    assert [name for name in left if name.startswith(PRIVATE_PREFIX) and name != MANIFEST_FILE] == private


def test_the_same_recipe_gives_the_same_bytes(world: World, tmp_path) -> None:
    """Issue 44, 8: two merges of one recipe give the same bytes, bookkeeping included: the manifest records each
    weight's size and SHA-256, nothing of the machine or the moment (device, inode, mtime)."""
    folders = [str(tmp_path / name / "out") for name in ("a", "b")]
    for folder in folders:
        merge_in_process(world.new_recipe, folder)
    first, second = ({name: Path(folder, name).read_bytes() for name in os.listdir(folder)} for folder in folders)
    assert first == second and MANIFEST_FILE in first
    weights = json.loads(first[MANIFEST_FILE])["weights"]
    assert weights == {"model.safetensors": {"size": len(first["model.safetensors"])}}
