"""Inputs are protected: a RAM merge whose output folder is, or is inside, a folder the recipe reads
is refused in one line before anything is read or written, however the folder is spelled.

The folders a recipe reads: the base, the models, a LoRA and where mergekit merges it, a
``tokenizer_source``, ``tokenizer: {source:}``, a token embedding's source, a Hub model's folder in
the Hub cache, and under ``mergekit-multi`` every stage's inputs (a stage must not write into what
another stage reads, but for the stages that merge its output). Refusals run through mergekit's
own ``run_merge`` in this process and through the real console scripts in subprocesses; the input
folders are compared byte for byte before and after.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml
from mergekit.config import MergeConfiguration
from mergekit.merge import run_merge
from mergekit.options import MergeOptions
from mergekit.scripts.merge_raw_pytorch import main as mergekit_pytorch

from mergekit_ram.errors import InputError
from tests.conftest import ModelSet, load_statistics, run_script, write_recipe
from tests.test_cli import one_line_error

EQUAL = "is the folder of the input"
INSIDE = "the merge would write into that input"


def _files(folder: str) -> dict[str, bytes]:
    """Every file under ``folder`` by relative path, links as their targets."""
    found = {}
    for root, _dirs, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            found[os.path.relpath(path, folder)] = (
                b"-> " + os.readlink(path).encode() if os.path.islink(path) else Path(path).read_bytes()
            )
    return found


def _spellings(folder: str, links: str) -> list[str]:
    """``folder`` as itself, with a trailing slash, through ``..``, and through a symbolic link in ``links``."""
    link = os.path.join(links, f"link-{len(os.listdir(links))}")
    os.symlink(folder, link)
    parent, name = os.path.split(folder)
    return [folder, folder + "/", os.path.join(parent, "..", os.path.basename(parent), name, ""), link, link + "/"]


@pytest.fixture
def models(bf16_models: ModelSet, tmp_path: Path) -> ModelSet:
    """A copy of the shared models: the shared ones are never used as an output, even by a broken plugin."""
    folder = shutil.copytree(os.path.dirname(bf16_models.base), str(tmp_path / "models"))
    return ModelSet(
        base=os.path.join(folder, "base"),
        agents=[os.path.join(folder, os.path.basename(path)) for path in bf16_models.agents],
        design=bf16_models.design,
    )


@pytest.fixture
def donor(models: ModelSet, tmp_path: Path) -> str:
    """A model the recipe reads only for its tokenizer (a copy of an agent, outside the merge's models)."""
    return shutil.copytree(models.agents[0], str(tmp_path / "donor"))


#: Where a recipe reads a folder, beyond its base and models: the recipe with ``donor`` read there.
READ_ALSO: dict[str, Callable[[ModelSet, str], dict[str, Any]]] = {
    "tokenizer_source": lambda models, donor: models.recipe("ram_plus", tokenizer_source=donor),
    "tokenizer.source": lambda models, donor: models.recipe("ram_plus", tokenizer={"source": donor}),
    "tokenizer.tokens": lambda models, donor: models.recipe(
        "ram_plus", tokenizer={"source": "base", "tokens": {"<tool>": {"source": donor}}}
    ),
    "a LoRA": lambda models, donor: {
        **models.recipe("ram_plus"),
        "models": [{"model": f"{models.agents[0]}+{donor}"}, *({"model": path} for path in models.agents[1:])],
    },
}


def _refusal(recipe: dict[str, Any], out: str, **options: Any) -> str:
    """The InputError ``run_merge`` refuses ``out`` with."""
    with pytest.raises(InputError) as raised:
        run_merge(MergeConfiguration.model_validate(recipe), out, options=MergeOptions(quiet=True, **options))
    return str(raised.value)


@pytest.mark.parametrize("where", ["base", "models", *READ_ALSO])
def test_an_input_folder_and_any_folder_inside_it_are_refused_however_spelled(
    models: ModelSet, donor: str, tmp_path: Path, where: str
) -> None:
    """The folder itself, or a folder inside it (there or not yet), each spelled five ways."""
    recipe = READ_ALSO[where](models, donor) if where in READ_ALSO else models.recipe("ram_plus")
    folder = {"base": models.base, "models": models.agents[1]}.get(where, donor)
    label = f"{models.agents[0]}+{donor}" if where == "a LoRA" else folder
    os.makedirs(os.path.join(folder, "merges"))
    before = {path: _files(path) for path in (models.base, *models.agents, donor)}
    links = str(tmp_path / "links")
    os.makedirs(links)
    for spelling in _spellings(folder, links):
        message = _refusal(recipe, spelling)
        assert message == (
            f"the output folder {spelling} is the folder of the input {label}: the merge would overwrite that input; "
            "choose another output folder"
        )
        for inside in (os.path.join(spelling, "merges"), os.path.join(spelling, "new", "deeper")):
            message = _refusal(recipe, inside)
            assert message == (
                f"the output folder {inside} is inside {folder}, the folder of the input {label}: the merge would "
                "write into that input; choose an output folder outside it"
            )
    assert {path: _files(path) for path in before} == before
    assert not os.path.exists(os.path.join(folder, "new"))


def test_the_folders_mergekit_reads_for_a_lora_and_a_hub_model_are_inputs(models: ModelSet, tmp_path: Path) -> None:
    """Where mergekit merges a LoRA (``--lora-merge-cache``) and a Hub model's folder in the Hub cache."""
    lora, cache, hub = str(tmp_path / "lora"), str(tmp_path / "lora-cache"), str(tmp_path / "hub")
    os.makedirs(lora)
    recipe = {
        **models.recipe("ram_plus"),
        "models": [{"model": f"{models.agents[0]}+{lora}"}, {"model": "example-org/tool-agent"}],
    }
    lora_input = f"the folder of the input {models.agents[0]}+{lora}"
    assert f"{cache} is {lora_input}" in _refusal(recipe, cache, lora_merge_cache=cache)
    out = os.path.join(cache, "merged", "out")  # anywhere in it: mergekit writes each merged LoRA there
    assert f"{out} is inside {cache}, {lora_input}" in _refusal(recipe, out, lora_merge_cache=cache)
    out = os.path.join(hub, "models--example-org--tool-agent", "snapshots", "main")
    assert "the folder of the input example-org/tool-agent" in _refusal(recipe, out, transformers_cache=hub)
    assert not os.path.exists(cache) and not os.path.exists(hub)


def test_mergekit_yaml_refuses_the_tokenizer_donor_and_a_folder_inside_the_base(
    models: ModelSet, donor: str, tmp_path: Path
) -> None:
    """The real console script: one line, exit 1, the donor's and the base's files untouched."""
    before = {path: _files(path) for path in (donor, models.base)}
    for key in ("tokenizer_source", "tokenizer.source"):
        recipe = write_recipe(str(tmp_path / f"{key}.yml"), READ_ALSO[key](models, donor))
        refused = run_script("mergekit-yaml", recipe, donor + "/", check=False)
        assert one_line_error(refused).startswith(f"the output folder {donor}/ {EQUAL} {donor}:")
    recipe = write_recipe(str(tmp_path / "plain.yml"), models.recipe("ram"))
    inside = os.path.join(models.base, "merged")
    refused = run_script("mergekit-yaml", recipe, inside, check=False)
    assert one_line_error(refused).startswith(f"the output folder {inside} is inside {models.base}, ")
    assert INSIDE in one_line_error(refused)
    assert {path: _files(path) for path in before} == before
    assert not os.path.exists(inside)


def test_mergekit_pytorch_may_write_beside_its_input_files_but_not_into_their_folder(
    models: ModelSet, tmp_path: Path
) -> None:
    """mergekit-pytorch reads files, not folders: the folder holding one is refused (the merge would
    replace its model.safetensors), a new folder inside it is not."""
    agent = models.agents[0]
    recipe = write_recipe(
        str(tmp_path / "pytorch.yml"),
        {
            "merge_method": "ram_plus",
            "base_model": os.path.join(models.base, "model.safetensors"),
            "models": [{"model": os.path.join(path, "model.safetensors")} for path in models.agents],
        },
    )
    before = _files(agent)
    spelled = os.path.join(agent, "..", os.path.basename(agent))
    refused = run_script("mergekit-pytorch", recipe, spelled, check=False)
    assert one_line_error(refused).startswith(f"the output folder {spelled} {EQUAL} {agent}/model.safetensors")
    assert _files(agent) == before
    mergekit_pytorch.main(args=[recipe, os.path.join(agent, "merged")], standalone_mode=False)
    assert load_statistics(os.path.join(agent, "merged"))["method"] == "ram_plus"


def _multi(path: str, stages: list[dict[str, Any]]) -> str:
    with open(path, "w", encoding="utf-8") as handle:
        yaml.safe_dump_all(stages, handle, sort_keys=False)
    return path


def test_a_mergekit_multi_stage_written_into_a_stage_it_reads_is_refused(models: ModelSet, tmp_path: Path) -> None:
    """Each stage is a merge of its own (run_merge), checked against the folders it reads: the final merge
    written inside the first stage's output, which it merges, is refused before it writes."""
    folder = os.path.dirname(models.base)
    base, (coding, tool, memory) = models.base, models.agents
    before = _files(folder)
    out = str(tmp_path / "out")
    # The final merge written inside a stage's output that it reads.
    first = {"name": "first", "merge_method": "ram_plus", "base_model": base}
    first["models"] = [{"model": coding}, {"model": tool}]
    final = {"merge_method": "ram", "base_model": base, "models": [{"model": "first"}, {"model": memory}]}
    config = _multi(str(tmp_path / "inside.yml"), [first, final])
    stages = str(tmp_path / "stages")
    inside = os.path.join(stages, "first", "final")
    refused = run_script(
        "mergekit-multi", config, "-I", stages, "--out-path", inside, "--no-copy-tokenizer", check=False
    )
    assert one_line_error(refused).startswith(
        f"the output folder {inside} is inside {os.path.join(stages, 'first')}, the folder of the input "
        f"{os.path.join(stages, 'first')}: the merge would write into that input"
    )
    assert _files(folder) == before and not os.path.exists(out) and not os.path.exists(inside)
    # The stages as they should be: the final merge reads the first stage's output.
    run_script("mergekit-multi", config, "-I", stages, "--out-path", out)
    assert load_statistics(out)["method"] == "ram" and load_statistics(os.path.join(stages, "first"))
