"""The README's worked example, end to end in this process: locally trained agents merged with mergekit-yaml,
the one step (``mergekit-ram check OUT --hub-id ... --set-license ...``), ``check`` clean; then the recipe left in
the folder rerun with the models in a Hugging Face cache under their Hub ids, offline, as far as mergekit 0.1.5
allows it: its weights and statistics equal the first merge's.

Where mergekit 0.1.5 stops offline (HF_HUB_OFFLINE=1), pinned here so that a mergekit that changes it is noticed:
it reads each model's config through transformers, which looks only in HF_HUB_CACHE (``--transformers-cache`` does
not reach it); it asks the Hub for the files of every model id that is not a folder here
(``huggingface_hub.list_repo_files``, before ``snapshot_download``), cached or not; and its card writer asks whether
an id that is a folder here is on the Hub (``huggingface_hub.repo_exists``). So offline the recipe reruns from a
folder where each id is a folder (as ``hf download ID --local-dir ID`` leaves it), with ``--no-write-model-card``.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import huggingface_hub
import pytest
import yaml
from click.testing import CliRunner
from mergekit.scripts.run_yaml import main as mergekit_yaml

from mergekit_ram.cli import main as mergekit_ram
from mergekit_ram.synthetic import PAPER_AGENTS, PAPER_OVERLAP, build_agents, tiny_config
from tests.test_check import MANIFEST_NOTE

#: The worked example's recipe (README.md), as a user writes it beside the models.
RECIPE = """\
merge_method: ram_plus
base_model: ./models/base            # local folders: start them with ./ (see below)
models:
  - model: ./models/coding-agent
  - model: ./models/tool-agent
  - model: ./models/memory-agent
parameters: {r: 0.1, alpha: 2.0}
dtype: bfloat16
"""
HUB_IDS = {
    "./models/base": "your-name/agents-base",
    "./models/coding-agent": "your-name/coding-agent",
    "./models/tool-agent": "your-name/tool-agent",
    "./models/memory-agent": "your-name/memory-agent",
}
REVISION = "0123456789abcdef0123456789abcdef01234567"


def invoke(command: Any, *arguments: str) -> Any:
    """A click command in this process, as its console script runs it (click's result)."""
    return CliRunner().invoke(command, list(arguments))


def place_in_hub_cache(cache: Path, model: Path, hub_id: str) -> Path:
    """``model``'s files as the hub library caches ``hub_id`` at ``REVISION``: its snapshot folder."""
    repository = cache / f"models--{hub_id.replace('/', '--')}"
    snapshot = repository / "snapshots" / REVISION
    shutil.copytree(model, snapshot)
    (repository / "refs").mkdir()
    (repository / "refs" / "main").write_text(REVISION, encoding="utf-8")
    return snapshot


def test_local_agents_to_the_hub_and_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    config = tiny_config("qwen2", hidden_size=32, intermediate_size=48, num_layers=2, vocab_size=64)
    build_agents("models", config, PAPER_OVERLAP, PAPER_AGENTS, seed=11)
    Path("recipe.yml").write_text(RECIPE, encoding="utf-8")
    merged = invoke(mergekit_yaml, "recipe.yml", "merged")
    assert merged.exit_code == 0, merged.output
    first = {name: Path("merged", name).read_bytes() for name in ("model.safetensors", "ram_statistics.json")}

    # The one step, then check clean.
    hub_ids = [f"--hub-id={local}={hub_id}" for local, hub_id in HUB_IDS.items()]
    step = invoke(mergekit_ram, "check", "merged", "--set-license", "mit", *hub_ids)
    assert (step.exit_code, step.stdout.splitlines()) == (0, [MANIFEST_NOTE, "ready to upload"]), step.output
    assert step.stderr == "rewrote ram_statistics.json, mergekit_config.yml, README.md\n"
    for name in ("README.md", "mergekit_config.yml", "ram_statistics.json"):
        text = Path("merged", name).read_text(encoding="utf-8")
        assert "models/" not in text and str(tmp_path) not in text, name
    recipe = Path("merged/mergekit_config.yml").read_text(encoding="utf-8")
    assert yaml.safe_load(recipe) == yaml.safe_load(
        RECIPE.replace("./models/base", "your-name/agents-base").replace("./models/", "your-name/")
    )  # the user's recipe, the ids in place of the folders (its comments are not kept)
    assert Path("merged/model.safetensors").read_bytes() == first["model.safetensors"]
    again = invoke(mergekit_ram, "check", "merged", "--set-license", "mit", *hub_ids)
    assert (again.exit_code, again.stdout, again.stderr) == (0, step.stdout, "")  # nothing left to change

    # The models in a Hugging Face cache under their Hub ids; the hub library finds them offline.
    assert huggingface_hub.constants.HF_HUB_OFFLINE
    cache = tmp_path / "hf-home" / "hub"
    snapshots = {hub_id: place_in_hub_cache(cache, Path(local), hub_id) for local, hub_id in HUB_IDS.items()}
    for hub_id, snapshot in snapshots.items():
        found = huggingface_hub.snapshot_download(hub_id, cache_dir=str(cache), local_files_only=True)
        assert Path(found) == snapshot
    shutil.rmtree("models")  # the local folders are gone: only the cache holds the models now

    # mergekit 0.1.5 reads each model's config through transformers, which looks in HF_HUB_CACHE: its own
    # --transformers-cache does not reach there.
    rerun = invoke(mergekit_yaml, "merged/mergekit_config.yml", "rerun", "--transformers-cache", str(cache))
    assert isinstance(rerun.exception, OSError)
    assert "couldn't find them in the cached files" in str(rerun.exception) and not os.path.exists("rerun")
    # HF_HUB_CACHE names the cache (the hub library reads the variable when it is imported, so this process also
    # sets the value it read): the configs are found offline, and then mergekit asks the Hub for the files.
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    rerun = invoke(mergekit_yaml, "merged/mergekit_config.yml", "rerun")
    assert isinstance(rerun.exception, huggingface_hub.errors.OfflineModeIsEnabled)
    assert "/api/models/your-name/" in str(rerun.exception) and "/tree/main" in str(rerun.exception)
    assert not os.path.exists("rerun")

    # Each id a folder here (what `hf download ID --local-dir ID` leaves; here a link into the cache): mergekit's
    # card writer would ask the Hub whether such an id is a Hub model once the merge is done, so the merge is
    # refused before it starts, with the spelling that names the folder.
    elsewhere = tmp_path / "elsewhere"
    for hub_id, snapshot in snapshots.items():
        (elsewhere / hub_id).parent.mkdir(parents=True, exist_ok=True)
        (elsewhere / hub_id).symlink_to(snapshot)
    monkeypatch.chdir(elsewhere)
    recipe_path, rerun_path = str(tmp_path / "merged/mergekit_config.yml"), tmp_path / "rerun"
    card_writer = invoke(mergekit_yaml, recipe_path, str(rerun_path))
    assert card_writer.exit_code == 1 and not rerun_path.exists()
    assert card_writer.stderr.strip() == (
        "Error: model path your-name/agents-base is a local folder written like a Hub id (org/name), which "
        "mergekit's model card would look up on the Hub once the merge is done: write it ./your-name/agents-base"
    )
    rerun = invoke(mergekit_yaml, recipe_path, str(rerun_path), "--no-write-model-card")
    assert rerun.exit_code == 0, rerun.output
    assert (rerun_path / "model.safetensors").read_bytes() == first["model.safetensors"]
    assert (rerun_path / "ram_statistics.json").read_bytes() == (tmp_path / "merged/ram_statistics.json").read_bytes()


def test_the_readme_shows_this_example() -> None:
    """README.md's worked example is the recipe and the flags run above."""
    readme = Path(__file__).parent.parent.joinpath("README.md").read_text(encoding="utf-8")
    assert f"```yaml\n{RECIPE}```" in readme
    step = "$ mergekit-ram check merged --set-license mit \\\n" + " \\\n".join(
        f"    --hub-id {local}={hub_id}" for local, hub_id in HUB_IDS.items()
    )
    assert f"$ mergekit-yaml recipe.yml merged\n{step}\n" in readme
    assert f"{MANIFEST_NOTE.removeprefix('note: ')}" in readme
