"""A mergekit the plugin does not support: outside the supported range its methods refuse in one line with the
pip command (one short warning at start-up, once), other methods run as mergekit alone; an internal moved within
the range is named in one line when a RAM merge needs it.

The "moved" mergekit is the installed one copied into a temporary folder, its version bumped where mergekit
keeps it (the distribution's metadata: mergekit has no ``__version__``; and the version its ``tensor_writer``
writes into an index), put first on ``PYTHONPATH`` of the real console scripts, as a source build kept beside
the plugin would be. The in-process tests stand the installed mergekit in for it.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
from pathlib import Path

import mergekit.merge
import pytest

from mergekit_ram.integration import internals
from tests.conftest import ModelSet, load_weights, mergekit_alone, run_process, run_script, script, write_recipe

VERSION = "0.2.0"
REFUSAL = f'mergekit-ram supports mergekit>=0.1.5,<0.2, not {VERSION}: pip install "mergekit==0.1.5"'
#: Logged while mergekit is imported, before any logging is set up: Python's last-resort handler prints it as is.
WARNING = f"{REFUSAL}; its methods will refuse to merge"


def build_moved_mergekit(root: Path) -> str:
    """The installed mergekit copied under ``root``, its version ``VERSION``: the folder to put on PYTHONPATH."""
    spec = importlib.util.find_spec("mergekit")
    assert spec is not None and spec.submodule_search_locations
    package = root / "mergekit"
    shutil.copytree(spec.submodule_search_locations[0], package, ignore=shutil.ignore_patterns("__pycache__"))
    writer = package / "io" / "tensor_writer.py"  # the version it writes into an index's metadata
    written = f'"mergekit_version": "{importlib.metadata.version("mergekit")}"'
    writer.write_text(writer.read_text(encoding="utf-8").replace(written, f'"mergekit_version": "{VERSION}"'), "utf-8")
    info = root / f"mergekit-{VERSION}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: mergekit\nVersion: {VERSION}\n", encoding="utf-8")
    return str(root)


@pytest.mark.process
def test_outside_the_range_one_warning_and_the_methods_refuse(bf16_models: ModelSet, tmp_path) -> None:
    """The real console script on a mergekit 0.2.0: one short warning line once, a RAM recipe refused in one
    line with the pip command and nothing written; a linear recipe writes what mergekit alone writes."""
    moved = build_moved_mergekit(tmp_path / "moved")
    env = {"PYTHONPATH": moved, "MERGEKIT_RAM_AUTOLOAD": "1"}
    out = tmp_path / "out"
    refused = run_process(
        [script("mergekit-yaml"), write_recipe(str(tmp_path / "r.yml"), bf16_models.recipe("ram_plus")), str(out)], env
    )
    assert (refused.returncode, refused.stderr.splitlines()) == (1, [WARNING, f"Error: {REFUSAL}"])
    assert len(WARNING) <= 120 and not out.exists()
    recipe = {
        "merge_method": "linear",
        "models": [{"model": path, "parameters": {"weight": 1.0}} for path in [bf16_models.base, *bf16_models.agents]],
        "dtype": "bfloat16",
    }
    path = write_recipe(str(tmp_path / "linear.yml"), recipe)
    aside, alone = tmp_path / "aside" / "out", tmp_path / "alone" / "out"  # one name: the card's title
    completed = run_process([script("mergekit-yaml"), path, str(aside), "--no-copy-tokenizer"], env)
    assert completed.returncode == 0 and completed.stderr.count("mergekit-ram") == 1, completed.stderr
    with mergekit_alone():
        run_script("mergekit-yaml", path, str(alone), "--no-copy-tokenizer")
    assert sorted(os.listdir(aside)) == sorted(os.listdir(alone)) == [
        "README.md", "config.json", "mergekit_config.yml", "model.safetensors"
    ]  # fmt: skip
    for name in ("config.json", "mergekit_config.yml", "model.safetensors"):
        assert (aside / name).read_bytes() == (alone / name).read_bytes(), name
    card, card_alone = ((folder / "README.md").read_text(encoding="utf-8") for folder in (aside, alone))
    assert sorted(card.splitlines()) == sorted(card_alone.splitlines())  # mergekit lists the models from a set
    assert load_weights(str(aside))


def test_every_way_to_merge_refuses_in_one_line(bf16_models: ModelSet, tmp_path, monkeypatch) -> None:
    """mergekit-yaml, mergekit-multi, mergekit-pytorch, ``mergekit-ram yaml`` and the probe: the refusal, and
    nothing created (this process's mergekit taken for a 0.2.0)."""
    monkeypatch.setattr(internals, "mergekit_version", lambda: VERSION)
    recipe = write_recipe(str(tmp_path / "r.yml"), bf16_models.recipe("ram"))
    stages = write_recipe(str(tmp_path / "multi.yml"), {"name": "agents", **bf16_models.recipe("ram_ties")})
    raw = {
        "merge_method": "ram_unique",
        "base_model": os.path.join(bf16_models.base, "model.safetensors"),
        "models": [{"model": os.path.join(path, "model.safetensors")} for path in bf16_models.agents],
    }
    runs = [
        ("mergekit-yaml", recipe, str(tmp_path / "out")),
        ("mergekit-ram", "yaml", recipe, str(tmp_path / "out")),
        ("mergekit-multi", stages, "-I", str(tmp_path / "stages"), "--out-path", str(tmp_path / "out")),
        ("mergekit-pytorch", write_recipe(str(tmp_path / "raw.yml"), raw), str(tmp_path / "raw")),
        ("mergekit-ram", "probe", recipe),
    ]
    for name, *args in runs:
        completed = run_script(name, *args, check=False)
        assert (completed.returncode, completed.stderr.splitlines()[-1:]) == (1, [f"Error: {REFUSAL}"]), args
    assert not any(os.path.exists(tmp_path / name) for name in ("out", "raw", "stages/agents"))


def test_an_internal_moved_within_the_range_is_named(bf16_models: ModelSet, tmp_path, monkeypatch) -> None:
    """A release in the range that renamed a helper the pre-pass plans with: the merge that needs it refuses in
    one line naming it and the pip command; nothing is written."""
    monkeypatch.delattr(mergekit.merge, "_model_out_config")
    out = tmp_path / "out"
    completed = run_script(
        "mergekit-yaml", write_recipe(str(tmp_path / "r.yml"), bf16_models.recipe("ram_plus")), str(out), check=False
    )
    version = importlib.metadata.version("mergekit")
    force = " --force-reinstall --no-deps" if version == "0.1.5" else ""
    assert (completed.returncode, completed.stderr.splitlines()[-1:]) == (
        1,
        [
            f"Error: mergekit-ram cannot find mergekit.merge._model_out_config in mergekit {version}; it supports "
            f'mergekit>=0.1.5,<0.2 where that is unchanged (tested: 0.1.5): pip install{force} "mergekit==0.1.5"'
        ],
    )
    assert not out.exists()
