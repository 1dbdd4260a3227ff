"""The pre-pass cache only ever helps (case 7): any problem is a warning and a fresh pre-pass.

Entries are planted where the real key of a real planned merge points; the counts that come
back must equal a pre-pass without the cache, and the log must name the entry and the way
to switch the cache off.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import shutil
import time
from typing import Any, Callable

import pytest
from mergekit.config import MergeConfiguration
from mergekit.merge import run_merge
from mergekit.options import MergeOptions
from safetensors.torch import load_file, save_file

from mergekit_ram import cache
from mergekit_ram.checks import HeaderCache
from mergekit_ram.integration.merge import counted, plan_merge
from mergekit_ram.stats.schema import counts_to_dict
from tests.conftest import ModelSet, load_statistics, merge_in_process, run_script, write_recipe

OPTIONS = MergeOptions(quiet=True)


def prepass(plan: Any) -> list[Any]:
    """The pre-pass counts of ``plan``, with the cache settings of the environment as a command reads them."""
    return counted(plan, OPTIONS, cache.CacheSettings.from_environment(), HeaderCache())


@pytest.fixture(scope="module")
def planned(bf16_models: ModelSet) -> tuple[Any, str, list[Any]]:
    """The merge tasks of a real ram_plus recipe, their cache key, and their uncached counts."""
    plan = plan_merge(MergeConfiguration.model_validate(bf16_models.recipe("ram_plus")), OPTIONS)
    return plan, cache.cache_key(plan.tensors), prepass(plan)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv(cache.MODE_VARIABLE, "on")
    monkeypatch.setenv(cache.DIRECTORY_VARIABLE, str(tmp_path / "cache"))
    return str(tmp_path / "cache")


def _entry(key: str) -> str:
    return cache.CacheSettings.from_environment().entry(key)


def _valid(planned: tuple[Any, str, list[Any]]) -> dict[str, Any]:
    plan, key, _ = planned
    prepass(plan)  # writes the entry
    with open(_entry(key), encoding="utf-8") as handle:
        return json.load(handle)


def _edit(change: Callable[[dict[str, Any]], Any], sign: bool = True) -> Callable[[dict[str, Any]], Any]:
    """The entry changed, and its checksum made to match (``sign``) so that the check after it is reached."""

    def edited(entry: dict[str, Any]) -> Any:
        change(entry)
        if sign:
            entry["sha256"] = cache.checksum(entry["tensors"])
        return entry

    return edited


def _fewer_shared(entry: dict[str, Any]) -> None:
    """One shared element counted as unique: the right shape, counts that fit, the wrong rho."""
    row = entry["tensors"][2]["histograms"][0]
    assert row[1] > 0
    row[0], row[1] = row[0] + 1, row[1] - 1


BROKEN = {
    "not JSON": lambda entry: "{ truncated",
    "a list": lambda entry: [1, 2, 3],
    "tensors not a list": lambda entry: {"tensors": 5},
    "null histograms": _edit(lambda entry: entry["tensors"][0].update(histograms=None)),
    "a tensor fewer": _edit(lambda entry: entry["tensors"].pop(3)),
    "tensors in another order": _edit(lambda entry: entry["tensors"].reverse()),
    "another model": _edit(lambda entry: entry["tensors"][2]["models"].__setitem__(0, "/elsewhere/agent")),
    "a wrong element count": _edit(lambda entry: entry["tensors"][1].update(numel=entry["tensors"][1]["numel"] + 1)),
    "a histogram row too long": _edit(lambda entry: entry["tensors"][4]["histograms"][0].append(0)),
    "counts changed, the checksum not": _edit(_fewer_shared, sign=False),
}


@pytest.mark.parametrize("damage", list(BROKEN), ids=list(BROKEN))
def test_a_broken_entry_is_a_warning_and_a_fresh_prepass(
    planned: tuple[list[Any], str, list[Any]], cache_dir: str, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    plan, key, fresh = planned
    broken = BROKEN[damage](_valid(planned))
    os.remove(_entry(key))
    with open(_entry(key), "w", encoding="utf-8") as handle:
        handle.write(broken if isinstance(broken, str) else json.dumps(broken))
    with caplog.at_level(logging.INFO):
        counts = prepass(plan)
    assert counts == fresh
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and _entry(key) in warnings[0] and "MERGEKIT_RAM_CACHE=off" in warnings[0], warnings
    assert any("pre-pass done" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.INFO):
        assert prepass(plan) == fresh  # the entry was rewritten and is used again
    assert any("using cached counts" in r.getMessage() for r in caplog.records)


def test_an_unwritable_cache_is_a_warning_and_the_merge_goes_on(
    bf16_models: ModelSet, planned: tuple[list[Any], str, list[Any]], cache_dir: str, tmp_path, caplog
) -> None:
    plan, key, fresh = planned
    # A file where the cache directory should be: a real merge still succeeds.
    with open(cache_dir, "w", encoding="utf-8") as handle:
        handle.write("in the way\n")
    out = str(tmp_path / "out")
    with caplog.at_level(logging.WARNING):
        run_merge(MergeConfiguration.model_validate(bf16_models.recipe("ram_plus")), out, options=OPTIONS)
    assert load_statistics(out)["tensors"] == [counts_to_dict(counts) for counts in fresh]
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(_entry(key) in m and "MERGEKIT_RAM_CACHE=off" in m and "the merge goes on" in m for m in messages)

    # A write that fails half-way (a file size limit: EFBIG, as a full disk gives ENOSPC): a warning,
    # and no .partial file is left.
    os.remove(cache_dir)
    os.makedirs(os.path.dirname(_entry(key)))
    caplog.clear()
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64, limits[1]))
    try:
        with caplog.at_level(logging.WARNING):
            assert prepass(plan) == fresh
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
    assert any("File too large" in r.getMessage() and _entry(key) in r.getMessage() for r in caplog.records)
    assert os.listdir(os.path.dirname(_entry(key))) == []


def _same_size_and_mtime_copy(file: str, work: str) -> str:
    """A copy of ``file`` with bytes changed between the fingerprint's sampled blocks, same mtime."""
    with open(file, "rb") as handle:
        data = bytearray(handle.read())
    offset = (1 << 20) + (1 << 16) + 100  # after the first MiB and the first sampled block
    assert len(data) > offset + (1 << 20)
    data[offset : offset + 8] = bytes(255 - b for b in data[offset : offset + 8])
    variant = os.path.join(work, "variant.safetensors")
    with open(variant, "wb") as handle:
        handle.write(bytes(data))
    status = os.stat(file)
    os.utime(variant, ns=(status.st_atime_ns, status.st_mtime_ns))
    return variant


@pytest.mark.parametrize("tool", ["cp -p", "rsync -a"])
def test_fingerprint_sees_a_file_replaced_with_the_same_size_and_mtime(tmp_path, tool: str) -> None:
    """Case 7: the change falls between the sampled blocks; identity and change time catch it."""
    file = str(tmp_path / "model.safetensors")
    with open(file, "wb") as handle:
        handle.write(os.urandom(4 << 20))
    before = cache.fingerprint(file)
    variant = _same_size_and_mtime_copy(file, str(tmp_path))
    time.sleep(0.05)  # change times have the kernel clock's resolution
    if tool == "cp -p":
        with open(variant, "rb") as source, open(file, "r+b") as target:  # what cp -p does: the same inode
            target.write(source.read())
        shutil.copystat(variant, file)
    else:
        shutil.copy2(variant, file + ".tmp")  # what rsync -a does: a new file renamed over the old
        os.replace(file + ".tmp", file)
    status = os.stat(file)
    assert (status.st_size, status.st_mtime_ns) == (4 << 20, os.stat(variant).st_mtime_ns)
    assert cache.fingerprint(file) != before


def test_an_index_only_change_counts_afresh(bf16_models: ModelSet, cache_dir: str, tmp_path) -> None:
    """Two shards both hold two tensors, one with the agent's values, one with the base's; the
    agent's index swaps which shard each is read from. The same files, other bytes: new counts."""
    agent = shutil.copytree(bf16_models.agents[0], str(tmp_path / "agent"))
    names = ["model.layers.0.mlp.up_proj.weight", "model.layers.1.mlp.up_proj.weight"]
    state = load_file(os.path.join(agent, "model.safetensors"))
    base = load_file(os.path.join(bf16_models.base, "model.safetensors"))
    save_file({name: state.pop(name) for name in names}, os.path.join(agent, "agent.safetensors"))
    save_file({name: base[name] for name in names}, os.path.join(agent, "base.safetensors"))
    save_file(state, os.path.join(agent, "model.safetensors"), metadata={"format": "pt"})
    shards = ["agent.safetensors", "base.safetensors"]
    weight_map = {tensor: "model.safetensors" for tensor in state} | dict(zip(names, shards))

    def merge(out: str) -> dict[str, Any]:
        with open(os.path.join(agent, "model.safetensors.index.json"), "w", encoding="utf-8") as handle:
            json.dump({"weight_map": weight_map}, handle)
        recipe = write_recipe(
            str(tmp_path / f"{out}.yml"),
            {
                **bf16_models.recipe("ram_plus"),
                "models": [{"model": agent}, *({"model": other} for other in bf16_models.agents[1:])],
            },
        )
        if out == "first":
            merge_in_process(recipe, str(tmp_path / out))
        else:  # mergekit keeps the indexes it has read for the life of a process
            log = run_script("mergekit-yaml", recipe, str(tmp_path / out), "-v").stderr
            assert "pre-pass done" in log and "using cached counts" not in log
        return {tensor["name"]: tensor for tensor in load_statistics(str(tmp_path / out))["tensors"]}

    first = merge("first")
    weight_map.update(zip(names, reversed(shards)))
    second = merge("second")
    assert [tensor for tensor in first if first[tensor] != second[tensor]] == names


# Where the cache lives: the user's cache folder, made with mode 0700; nothing checks who else may write it (a cache
# shared between users is out of the threat model, docs/reliability.md).


def test_the_cache_folder_may_be_a_link_the_user_made_and_is_made_private(
    planned: tuple[Any, str, list[Any]], cache_dir: str, tmp_path, monkeypatch, caplog
) -> None:
    """A link on the way to the cache folder is the user's choice (followed); the folders the cache makes are the
    user's alone (0700)."""
    plan, key, fresh = planned
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", tmp_path / "link")
    monkeypatch.setenv(cache.DIRECTORY_VARIABLE, str(tmp_path / "link" / "cache"))
    target = tmp_path / "elsewhere" / "cache"
    prepass(plan)
    for folder in (target, target / "prepass"):
        assert os.stat(folder).st_mode & 0o7777 == 0o700, folder
    caplog.clear()
    with caplog.at_level(logging.INFO):
        assert prepass(plan) == fresh
    assert any("using cached counts" in r.getMessage() for r in caplog.records)
    assert os.path.isfile(target / "prepass" / f"{key}.json")
