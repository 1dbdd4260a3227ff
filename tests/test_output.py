"""A RAM merge never destroys data: the output transaction, the lock, protected inputs, through the
real console scripts (tests/test_transaction.py enumerates every operation of the transaction itself).

Every faulted run is the real console script in a subprocess, on real files (the set-up merges
it is compared with, and runs that only check a refusal, run in this process through the same
mergekit entry points). Faults are injected by
``tests/faults/sitecustomize.py`` (put on the subprocess's PYTHONPATH; the library has no test
hooks): a signal or a full disk at a named moment, and each outcome is compared byte for byte
with the folder before the merge ("old") and with the same merge run without a fault ("new").
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import shutil
import signal
import subprocess
import time
from hashlib import sha256
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest
import yaml
from mergekit.config import MergeConfiguration
from mergekit.merge import run_merge
from mergekit.options import MergeOptions
from mergekit.scripts.merge_raw_pytorch import main as mergekit_pytorch

from mergekit_ram.errors import InputError
from mergekit_ram.staging import LOCK_FILE, MANIFEST_FILE, MARKER_FILE, MARKER_TEXT, PRIVATE_PREFIX
from tests.conftest import (
    ModelSet,
    command_refusal,
    merge_in_process,
    run_process,
    run_script,
    script,
    write_recipe,
)
from tests.test_prepass import save_tokenizer

FAULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "faults")
USER_FILES = {
    "notes.txt": b"my notes\n",
    "adapter_model.safetensors": b"not really an adapter",
    "my_embeddings.safetensors": b"user embeddings",
    "pytorch_model_backup.bin": b"a backup",
    "adapter_config.json": b"{}\n",
}
#: Operations of the transaction (``fsop:any:N``, tests/faults/sitecustomize.py) re-merging the world's folder:
#: 1-7 lock and prepare, 8-20 the manifest written and the old weights read, 24 the marker is written,
#: 28 config.json leaves, 29-41 the old files, 42-50 the new ones.
LAST_OF_BEGIN, RECORDING, MARKER_WRITTEN, CONFIG_LEAVES, OLD_SHARDS, NEW_FILES = 7, 15, 24, 28, 33, 46


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


@contextlib.contextmanager
def plugin_log() -> Iterator[io.StringIO]:
    """What mergekit-ram logs at INFO meanwhile (what -v shows)."""
    logger, text = logging.getLogger("mergekit_ram"), io.StringIO()
    handler, level = logging.StreamHandler(text), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield text
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


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
        self.old = snapshot(self.make_old("template"))
        reference = self.make_old("reference")
        with plugin_log() as log:
            merge_in_process(self.new_recipe, reference)
        self.log = log.getvalue()
        self.new = snapshot(reference)

    def make_old(self, name: str) -> str:
        """A folder in the old state: the earlier merge made there (so its manifest records these files
        as they are; a copy would have other inodes), and the user's files beside it."""
        out = os.path.join(self.root, name, "out")
        merge_in_process(self.old_recipe, out, out_shard_size=8000)
        for user_file, data in USER_FILES.items():
            with open(os.path.join(out, user_file), "wb") as handle:
                handle.write(data)
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
    assert manifest["weights"] == {"model.safetensors": {"size": len(weights), "sha256": sha256(weights).hexdigest()}}
    assert "tokenizer.json" in manifest["files"]
    assert "removed model-00001-of-" in world.log and "model.safetensors.index.json" in world.log
    with open(os.path.join(world.root, "reference", "out", "README.md"), encoding="utf-8") as handle:
        card = handle.read()
    assert card.startswith("---") and "\n# out\n" in card and "## RAM statistics" in card


FAULT_CASES = [
    # (fault, outcome): "old" = byte for byte the folder before, "new" = the complete new merge
    ("kernel:prepass:3:SIGINT", "old"),
    ("kernel:merge:5:SIGTERM", "old"),
    ("kernel:merge:2:SIGHUP", "old"),  # an ssh disconnect
    ("open:config.json:1:SIGINT", "old"),  # mergekit wrote the new config (case 5)
    ("open:tokenizer.json:1:SIGUSR1", "old"),
    ("open:README.md:1:ENOSPC", "old"),  # disk full while the card is written (case 5)
    (f"fsop:any:{LAST_OF_BEGIN}:SIGTERM", "old"),  # held while the folder is prepared, then acted on
    (f"fsop:any:{RECORDING}:SIGINT", "old"),  # while the weights are read for the manifest: not held
    (f"fsop:any:{CONFIG_LEAVES}:SIGINT", "new"),  # signals are held while publishing (case 6)
    (f"fsop:any:{OLD_SHARDS}:SIGQUIT", "new"),
    (f"fsop:any:{NEW_FILES}:SIGHUP", "new"),
    (f"fsop:any:{NEW_FILES}:SIGUSR1", "new"),
]


@pytest.mark.parametrize(("fault", "outcome"), FAULT_CASES, ids=[fault for fault, _ in FAULT_CASES])
def test_a_fault_leaves_the_old_folder_or_the_complete_new_merge(world: World, fault: str, outcome: str) -> None:
    out = world.make_old(fault.replace(":", "-").replace("/", "-"))
    completed = faulted("mergekit-yaml", world.new_recipe, out, fault=fault)
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


def test_a_killed_publish_is_marked_and_never_replayed(world: World) -> None:
    """SIGKILL in the middle of publishing: marked, not loadable. Then a merge with mergekit's own
    ``linear`` and a RAM merge that fails: nothing of the killed merge comes back over the linear one.
    A failed rename instead: undone at once by the same process."""
    out = world.make_old("killed-ENOSPC")
    fault = f"fsop:any:{OLD_SHARDS}:ENOSPC"
    failed = faulted("mergekit-yaml", world.new_recipe, out, fault=fault)
    assert failed.returncode == 1 and "it holds what it held before" in failed.stderr
    assert snapshot(out) == world.old
    out = world.make_old("killed-SIGKILL")
    fault = f"fsop:any:{OLD_SHARDS}:SIGKILL"
    assert faulted("mergekit-yaml", world.new_recipe, out, fault=fault).returncode == -9
    left = os.listdir(out)
    assert MARKER_FILE in left and "config.json" not in left  # neither transformers nor --lazy takes it
    with open(os.path.join(out, MARKER_FILE), encoding="utf-8") as handle:
        assert handle.read() == MARKER_TEXT  # it says what it means and what to do
    merge_in_process(world.models.recipe("linear", parameters={"weight": 1.0}), out)
    linear = snapshot(out)
    del linear[LOCK_FILE]  # the killed merge's, taken over and removed by the next RAM merge (it holds nothing)
    # a RAM merge that fails in its own merge
    refused = faulted("mergekit-yaml", world.new_recipe, out, fault="kernel:merge:1:ENOSPC")
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
    with _paused_merge(world.new_recipe, out, str(tmp_path / "release")) as merge:
        with open(os.path.join(out, "notes.txt"), "w", encoding="utf-8") as handle:
            handle.write("my notes\n")
        merge.send_signal(signal.SIGINT)
    assert merge.returncode != 0
    assert snapshot(out) == {"notes.txt": b"my notes\n"}
    empty = str(tmp_path / "empty" / "a" / "out")  # without the notes, every folder the merge made goes
    failed = faulted("mergekit-yaml", world.new_recipe, empty, fault="kernel:merge:2:SIGTERM")
    assert failed.returncode == -signal.SIGTERM and not os.path.exists(str(tmp_path / "empty"))


@contextlib.contextmanager
def _paused_merge(recipe: str, out: str, release: str) -> Iterator[subprocess.Popen]:
    """``mergekit-yaml recipe out`` in a subprocess, held at the kernel's second merge call while the
    block runs; released and waited for (2 minutes at most) when it ends."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **fault_env("kernel:merge:2:wait", MERGEKIT_RAM_TEST_RELEASE=release)}
    merge = subprocess.Popen([script("mergekit-yaml"), recipe, out], env=env, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not os.path.exists(release + ".waiting") and time.monotonic() < deadline and merge.poll() is None:
            time.sleep(0.05)
        assert os.path.exists(release + ".waiting"), "the merge never reached the fault"
        yield merge
    finally:
        open(release, "w").close()
        merge.wait(120)


def test_a_second_merge_into_a_busy_folder_is_refused_at_once(world: World) -> None:
    """Case 4: one merge per output folder, by an OS lock."""
    out = world.make_old("busy")
    with _paused_merge(world.new_recipe, out, os.path.join(world.root, "busy", "release")) as first:
        during = snapshot(out)
        second = run_script("mergekit-yaml", world.old_recipe, out, check=False)
        assert second.returncode != 0
        assert f"another merge is writing to {out}" in second.stderr
        assert snapshot(out) == during
    assert first.returncode == 0, first.stderr.read().decode()[-3000:] if first.stderr else ""
    assert snapshot(out) == world.new


def test_one_writer_whatever_removes_the_lock(world: World, tmp_path) -> None:
    """Case 3: ``rm -rf OUT/.*`` (or ``git clean -fdx``) removes a running merge's lock file and its private
    folder, so a second merge may run and publish: the first then publishes nothing over it. After ``rm -rf
    OUT`` a third merge makes a new OUT, and the first merge's failure leaves that alone too."""
    out = str(tmp_path / "made-by-the-first" / "out")
    with _paused_merge(world.new_recipe, out, str(tmp_path / "release")) as first:
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
        third = snapshot(out)
    assert first.returncode != 0
    assert snapshot(out) == third and "config.json" in third


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
    marker = f"fsop:any:{MARKER_WRITTEN}:ENOSPC"  # the disk is full when the marker is written: nothing moved yet
    failed = faulted("mergekit-pytorch", recipe, out, fault=marker)
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
    killed = faulted("mergekit-multi", config, "-I", str(stages), fault="fsop:any:23:SIGKILL")
    assert killed.returncode == -signal.SIGKILL
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
    assert weights == {"model.safetensors": {"size": len(first["model.safetensors"]),
                                             "sha256": sha256(first["model.safetensors"]).hexdigest()}}  # fmt: skip


def _without_proc() -> list[str]:
    """The command that runs its arguments where /proc is not mounted: a private mount namespace (a user namespace
    too unless root) whose /proc is an empty tmpfs. Skips, saying why, where this machine allows none."""
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("no unshare(1) here, so no private mount namespace to hide /proc in")
    user = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
    hidden = 'mount -t tmpfs none /proc && test ! -e /proc/self && "$@"'
    command = [unshare, *user, "--mount", "--propagation", "private", "sh", "-c", hidden]
    probe = subprocess.run([*command, "sh", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"this machine allows no private mount namespace to hide /proc in: {probe.stderr.strip()[-300:]}")
    return [*command, "sh"]


@pytest.mark.process
def test_a_merge_without_proc(world: World, tmp_path) -> None:
    """Issue 44, 2: where /proc is not mounted (a container or chroot), mergekit-yaml merges (the inputs read by
    path, checked to be the files opened; mergekit writes by the plain path, checked to name the private folder),
    ``probe`` reads the recipe, and ``check`` names /proc, not the model. The folder is the bytes of a merge with
    /proc."""
    without_proc = _without_proc()
    out, reference = str(tmp_path / "without" / "out"), str(tmp_path / "with" / "out")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    merged = subprocess.run([*without_proc, script("mergekit-yaml"), world.new_recipe, out], env=env,
                            capture_output=True, text=True, timeout=600)  # fmt: skip
    assert merged.returncode == 0, merged.stderr[-3000:]
    probed = subprocess.run([*without_proc, script("mergekit-ram"), "probe", world.new_recipe], env=env,
                            capture_output=True, text=True, timeout=600)  # fmt: skip
    assert probed.returncode == 0 and "memory-agent" in probed.stdout, probed.stderr[-3000:]
    checked = subprocess.run([*without_proc, script("mergekit-ram"), "check", out], env=env,
                             capture_output=True, text=True, timeout=600)  # fmt: skip
    assert "problem: model.safetensors cannot be read: /proc is not mounted here (mount it)" in checked.stdout
    merge_in_process(world.new_recipe, reference)
    assert snapshot(out) == snapshot(reference)
