"""Input folders are a stranger's: only the files mergekit itself reads are opened, each bounded
and without blocking, and what cannot be read is refused in one line before anything is written.

The models here are a sharded copy of ``bf16_models``' first agent laid out as a Hugging Face
cache snapshot (every file a symbolic link into a folder of blobs). Runs that could hang on a
FIFO run under an alarm (``hang_fails``): a merge that waits on one fails instead of hanging the suite.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Callable

import pytest
import torch
from mergekit.scripts.merge_raw_pytorch import main as mergekit_pytorch
from mergekit.scripts.run_yaml import main as mergekit_yaml
from safetensors.torch import load_file, save_file

from mergekit_ram.stats.render import model_table
from mergekit_ram.stats.schema import statistics_from_dict
from tests.conftest import (
    Merged,
    ModelSet,
    command_refusal,
    hang_fails,
    load_statistics,
    load_weights,
    merge_in_process,
    run_script,
    write_recipe,
)

INDEX = "model.safetensors.index.json"


def _stray(kind: str, path: str) -> None:
    """A file no index names, of one kind that has broken merges that opened every *.safetensors."""
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "git-LFS pointer":
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(f"version https://git-lfs.github.com/spec/v1\noid sha256:{'0' * 64}\nsize 1234\n")
    elif kind == "link to /dev/zero":
        os.symlink("/dev/zero", path)
    elif kind == "sparse 64 GiB":
        with open(path, "wb") as handle:
            handle.truncate(64 << 30)
    elif kind == "64 MB header":  # a valid safetensors file without tensors
        header = json.dumps({"__metadata__": {"padding": "x" * (64 << 20)}}).encode()
        with open(path, "wb") as handle:
            handle.write(len(header).to_bytes(8, "little") + header)
    else:  # "folder"
        os.mkdir(path)


STRAYS = ["fifo", "git-LFS pointer", "link to /dev/zero", "sparse 64 GiB", "64 MB header", "folder"]


@pytest.fixture(scope="module")
def snapshot(bf16_models: ModelSet, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The first agent as two shards and an index, each file a symbolic link into ``blobs/``."""
    root = tmp_path_factory.mktemp("snapshot")
    state = load_file(os.path.join(bf16_models.agents[0], "model.safetensors"))
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    blobs, folder = root / "blobs", root / "snapshot"
    os.makedirs(blobs)
    os.makedirs(folder)
    for shard, members in shards.items():
        save_file({name: state[name] for name in members}, str(blobs / shard), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {name: shard for shard, members in shards.items() for name in members}}
    (blobs / INDEX).write_text(json.dumps(index), encoding="utf-8")
    shutil.copy(os.path.join(bf16_models.agents[0], "config.json"), blobs / "config.json")
    for blob in os.listdir(blobs):
        os.symlink(blobs / blob, folder / blob)  # absolute, so that copies of the folder keep them
    return str(folder)


def _with_agent(models: ModelSet, agent: str) -> dict:
    recipe = models.recipe("ram_plus")
    recipe["models"][0] = {"model": agent}
    return recipe


def test_stray_files_are_never_opened(bf16_models: ModelSet, snapshot: str, ram_plus_merge: Merged, tmp_path) -> None:
    """Every stray kind beside the shards (and a FIFO as model.safetensors and pytorch_model.bin,
    which mergekit passes over for the index): the merge is the clean merge, byte for byte. The
    folder's name holds a `|` and a line break, which the card's and the terminal's tables keep
    on one row."""
    agent = str(tmp_path / "coding | agent\nsnapshot")
    shutil.copytree(snapshot, agent, symlinks=True)
    for number, kind in enumerate(STRAYS):
        _stray(kind, os.path.join(agent, f"stray-{number}.safetensors"))
    for name in ("model.safetensors", "pytorch_model.bin"):
        os.mkfifo(os.path.join(agent, name))
    recipe = write_recipe(str(tmp_path / "r.yml"), _with_agent(bf16_models, agent))
    out = str(tmp_path / "out")
    with hang_fails():
        completed = run_script("mergekit-yaml", recipe, out, check=False)
    assert completed.returncode == 0, completed.stderr[-3000:]
    for name in ("model.safetensors", "ram_statistics.json"):
        with open(os.path.join(out, name), "rb") as merged, open(os.path.join(ram_plus_merge.out, name), "rb") as clean:
            expected = clean.read().replace(bf16_models.agents[0].encode(), json.dumps(agent)[1:-1].encode())
            assert merged.read() == expected, name

    statistics = statistics_from_dict(load_statistics(out))
    with open(os.path.join(out, "README.md"), encoding="utf-8") as handle:
        card = handle.read()
    table = card[card.index("| model | density |") :].split("\n\n")[0].splitlines()
    assert len(table) == 2 + len(statistics.models)
    assert table[2].startswith("| /") and "/coding \\| agent<br>snapshot | " in table[2]
    assert all(row.replace("\\|", "").count("|") == 8 for row in table)
    shown = model_table(statistics)  # as the terminal showed it after the merge
    assert shown in completed.stderr and len(shown.splitlines()) == 4 + len(statistics.models)
    assert "coding | agent\\nsnapshot" in shown


def _named(snapshot: str, root: str, kind: str) -> str:
    """The snapshot with its index putting one tensor into a stray file of ``kind``."""
    agent = shutil.copytree(snapshot, os.path.join(root, "agent"), symlinks=True)
    _stray(kind, os.path.join(agent, "stray.safetensors"))
    with open(os.path.join(agent, INDEX), encoding="utf-8") as handle:
        index = json.load(handle)
    index["weight_map"][sorted(index["weight_map"])[0]] = "stray.safetensors"
    os.remove(os.path.join(agent, INDEX))
    with open(os.path.join(agent, INDEX), "w", encoding="utf-8") as handle:
        json.dump(index, handle)
    return agent


NAMED = {
    "fifo": "(it is not a regular file); put the model's weights file there",
    "git-LFS pointer": "stray.safetensors is a git-LFS pointer, not the weights: run `git lfs pull`",
    "link to /dev/zero": "(it is not a regular file); put the model's weights file there",
    "sparse 64 GiB": "the file is truncated or corrupt",
    "64 MB header": "in stray.safetensors, which does not hold it",
    "folder": "(it is not a regular file); put the model's weights file there",
}


@pytest.mark.parametrize("kind", list(NAMED))
def test_a_stray_file_the_index_names_is_refused_in_one_line(
    bf16_models: ModelSet, snapshot: str, tmp_path, kind: str
) -> None:
    agent = _named(snapshot, str(tmp_path), kind)
    recipe = write_recipe(str(tmp_path / "r.yml"), _with_agent(bf16_models, agent))
    out = str(tmp_path / "out")
    with hang_fails():  # a FIFO would hang a merge that waited on it
        message = command_refusal(mergekit_yaml, recipe, out)
    assert message.startswith(f"{agent}: ") and NAMED[kind] in message, message
    assert not os.path.exists(out)


def _as_bin(models: ModelSet, root: str) -> dict[str, str]:
    """Each model's weights saved with torch.save: {safetensors file: .bin file}."""
    files = {}
    for index, model in enumerate([models.base, *models.agents]):
        source = os.path.join(model, "model.safetensors")
        files[source] = os.path.join(root, f"model-{index}.bin")
        torch.save(load_file(source), files[source])
    return files


def _pytorch_merge(models: ModelSet, method: str, files: Callable[[str], str], out: str) -> dict[str, torch.Tensor]:
    """``mergekit-pytorch`` (its click command, in this process) on one file per model."""
    recipe = {
        "merge_method": method,
        "base_model": files(os.path.join(models.base, "model.safetensors")),
        "models": [{"model": files(os.path.join(agent, "model.safetensors"))} for agent in models.agents],
    }
    mergekit_pytorch.main(args=[write_recipe(out + ".yml", recipe), out], standalone_mode=False)
    return load_file(os.path.join(out, "model.safetensors"))


@pytest.mark.parametrize("method", ["ram", "ram_plus"])
def test_bin_inputs_are_left_to_mergekit(bf16_models: ModelSet, tmp_path, method: str) -> None:
    """``mergekit-pytorch`` on .bin files merges what it merges from the same safetensors files."""
    files = _as_bin(bf16_models, str(tmp_path))
    from_bin = _pytorch_merge(bf16_models, method, files.__getitem__, str(tmp_path / "from-bin"))
    from_safetensors = _pytorch_merge(bf16_models, method, lambda file: file, str(tmp_path / "from-safetensors"))
    assert from_bin.keys() == from_safetensors.keys()
    assert all(torch.equal(from_bin[name], tensor) for name, tensor in from_safetensors.items())


def test_a_model_stored_as_pytorch_model_bin_merges(bf16_models: ModelSet, ram_plus_merge: Merged, tmp_path) -> None:
    agent = str(tmp_path / "agent")
    os.makedirs(agent)
    shutil.copy(os.path.join(bf16_models.agents[0], "config.json"), agent)
    torch.save(load_file(os.path.join(bf16_models.agents[0], "model.safetensors")), f"{agent}/pytorch_model.bin")
    out = str(tmp_path / "out")
    merge_in_process(_with_agent(bf16_models, agent), out)
    merged, clean = load_weights(out), load_weights(ram_plus_merge.out)
    assert merged.keys() == clean.keys() and all(torch.equal(merged[name], clean[name]) for name in clean)
