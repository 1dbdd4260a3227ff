"""The one step to the Hub (``mergekit-ram check OUT --hub-id LOCAL=ID``): how local folders are matched, what is
refused before anything is written, that a second run changes nothing; and a test for each group of the attack on
it in issue 50."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from mergekit_ram.hub_ids import recipe_paths, renamed_recipe
from tests.conftest import Merged, ModelSet, merge_in_process
from tests.test_check import MANIFEST_NOTE, check, hub_id_options, refused, run, snapshot

RENAMES = {
    "/m/base": "org/base",
    "/m/coder": "org/coder",
    "/m/tool": "org/tool",
    "/m/memory": "org/memory",
    "/m/memory-lora": "org/memory-lora@0123abc",
}


def test_every_reference_form_is_renamed() -> None:
    """Each model reference mergekit reads, wherever the recipe has one: LoRA references and revisions as
    mergekit splits them, nested references, tokenizer sources (but its own words ``base`` and ``union``)."""
    recipe = yaml.safe_load(
        """\
merge_method: ram_plus
base_model: /m/base
models:
  - model: /m/coder
  - model: /m/memory+/m/memory-lora@v1
  - model: {model: {path: /m/tool, revision: main}, override_architecture: Qwen2ForCausalLM}
slices:
  - sources:
      - {model: /m/coder@v2, layer_range: [0, 2]}
tokenizer_source: base
tokenizer:
  source: union
  tokens:
    "<x>": {source: {kind: model_token, model: /m/coder, token: a}}
    "<y>": {source: /m/tool}
"""
    )
    renamed = renamed_recipe(recipe, RENAMES)
    assert recipe_paths(renamed) == [
        "org/base", "org/coder", "org/memory", "org/memory-lora", "org/tool", "org/coder", "org/coder", "org/tool"
    ]  # fmt: skip
    assert renamed["models"][1]["model"] == "org/memory+org/memory-lora@0123abc"
    assert (renamed["tokenizer_source"], renamed["tokenizer"]["source"]) == ("base", "union")
    assert renamed_recipe(renamed, RENAMES) == renamed


def test_a_path_beside_its_revision_takes_no_revision_in_its_id(ram_plus_merge: Merged, bf16_models, tmp_path) -> None:
    folder = tmp_path / "out"
    shutil.copytree(ram_plus_merge.out, folder)
    recipe = (folder / "mergekit_config.yml").read_text(encoding="utf-8")
    (folder / "mergekit_config.yml").write_text(
        recipe.replace(f"base_model: {bf16_models.base}", f"base_model: {{model: {{path: {bf16_models.base}}}}}"),
        encoding="utf-8",
    )
    before = snapshot(folder)
    options = [option.replace("=org/base", "=org/base@v1") for option in hub_id_options(bf16_models)]
    assert refused(folder, *options) == (
        f"Error: mergekit_config.yml names {bf16_models.base} as a path beside its revision: give its Hub id "
        "without @revision, and write the revision into the recipe's revision field"
    )
    assert snapshot(folder) == before


@pytest.fixture
def merged(ram_plus_merge: Merged, tmp_path: Path) -> Path:
    """A copy of the shared local merge, with a tokenizer: one step from ready."""
    folder = tmp_path / "out"
    shutil.copytree(ram_plus_merge.out, folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_text("{}", encoding="utf-8")
    return folder


def test_local_folders_are_matched_however_typed(
    merged: Path, bf16_models: ModelSet, run_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The recipe holds absolute paths; the user types them from where they are, with or without ./ or a
    final /, or through a link: the same folders."""
    monkeypatch.chdir(run_root)
    relative = {path: os.path.relpath(path, run_root) for path in [bf16_models.base, *bf16_models.agents]}
    os.symlink(os.path.dirname(bf16_models.base), merged.parent / "linked")
    typed = [
        f"./{relative[bf16_models.base]}",
        f"{relative[bf16_models.agents[0]]}/",
        str(merged.parent / "linked" / os.path.basename(bf16_models.agents[1])),
        bf16_models.agents[2],
    ]
    options = [f"--hub-id={local}=org/{os.path.basename(local.rstrip('/'))}" for local in typed]
    assert check(merged, *options) == (
        1,
        [MANIFEST_NOTE, "problem: " + LICENSE_PROBLEM, "1 problem(s): do not upload yet"],
    )


LICENSE_PROBLEM = (
    "the card's front matter has no license: mergekit-ram check OUT --set-license ID, with an id the input "
    "models' licences allow (apache-2.0, mit, ...)"
)


def test_what_cannot_be_named_is_refused_before_anything_is_written(merged: Path, bf16_models: ModelSet) -> None:
    """A local model without an id (named in the one line), an id for a folder the merge did not read, two
    models given one id: refused, nothing written, the licence neither."""
    before = snapshot(merged)
    options = hub_id_options(bf16_models)
    coding, tool, memory = bf16_models.agents
    assert refused(merged, *options[:2], "--set-license", "mit") == (
        f"Error: {merged} names local models without a Hub id: {coding.replace('coding', 'tool')}, {memory}; give "
        f"each one: --hub-id {tool}=ORG/NAME (or a --hub-id-file of them all); nothing was changed"
    )
    assert refused(merged, *options, "--hub-id", "/nowhere/agent=org/agent") == (
        f"Error: --hub-id /nowhere/agent=org/agent: {merged} names no model at /nowhere/agent; its local models: "
        f"{bf16_models.base}, {coding}, {tool}, {memory}; nothing was changed"
    )
    same = [*options[:3], f"--hub-id={memory}=org/coding-agent"]
    assert refused(merged, *same) == (
        f"Error: {coding} and {memory} would both be named org/coding-agent: give each model its own Hub id; "
        "nothing was changed"
    )
    assert snapshot(merged) == before


def test_a_mapping_file_is_the_flags(merged: Path, bf16_models: ModelSet, tmp_path: Path) -> None:
    """YAML or JSON ``{local: id}`` gives the bytes ``--hub-id`` gives; a second run changes nothing."""
    ids = {path: f"org/{os.path.basename(path)}" for path in [bf16_models.base, *bf16_models.agents]}
    results = []
    for name, text in (("ids.json", json.dumps(ids)), ("ids.yml", "".join(f"{k}: {v}\n" for k, v in ids.items()))):
        folder = tmp_path / name
        shutil.copytree(merged, folder)
        (tmp_path / f"{name}.map").write_text(text, encoding="utf-8")
        assert check(folder, "--hub-id-file", str(tmp_path / f"{name}.map"), "--set-license", "mit")[0] == 0
        results.append(snapshot(folder))
    assert check(merged, *hub_id_options(bf16_models), "--set-license", "mit")[0] == 0
    assert results == [snapshot(merged)] * 2
    times = {path.name: path.stat().st_mtime_ns for path in merged.iterdir()}
    report = json.loads(
        run("check", str(merged), *hub_id_options(bf16_models), "--set-license", "mit", "--json").stdout
    )
    assert report["changed"] == [] and report["ready"]
    assert {path.name: path.stat().st_mtime_ns for path in merged.iterdir()} == times


def test_the_statistics_stay_valid_and_name_only_ids(merged: Path, bf16_models: ModelSet) -> None:
    """Every model name of the statistics (rows, tensors, modules, warnings) renamed, the file read by its
    reader and laid out as a merge writes it."""
    from mergekit_ram.stats.schema import statistics_from_dict, statistics_to_json

    data = json.loads((merged / "ram_statistics.json").read_text(encoding="utf-8"))
    data["warnings"] = [f"{bf16_models.agents[0]}: lambda 5.0 is implausibly large"]
    (merged / "ram_statistics.json").write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    run("check", str(merged), *hub_id_options(bf16_models))
    text = (merged / "ram_statistics.json").read_text(encoding="utf-8")
    assert bf16_models.base.rsplit("/", 2)[0] not in text
    renamed = json.loads(text)
    assert renamed["warnings"] == ["org/coding-agent: lambda 5.0 is implausibly large"]
    assert [row["model"] for row in renamed["models"]] == ["org/coding-agent", "org/tool-agent", "org/memory-agent"]
    assert statistics_to_json(statistics_from_dict(renamed)) == text


def test_the_licence_alone_changes_nothing_else(upstream_ram_merge: Merged, tmp_path: Path) -> None:
    """``--set-license`` without ``--hub-id``: the front matter gains the licence; the rest of the card, its
    model list's order included, and the other files stay byte for byte."""
    folder = tmp_path / "out"
    shutil.copytree(upstream_ram_merge.out, folder)
    card = (folder / "README.md").read_text(encoding="utf-8")
    listed = card.index("* ")
    (folder / "README.md").write_text(card[:listed] + "* zzz\n" + card[listed:], encoding="utf-8")  # unsorted
    before = snapshot(folder)
    assert run("check", str(folder), "--set-license", "mit").stderr == "rewrote README.md\n"
    after = snapshot(folder)
    assert {name for name in before if before[name] != after[name]} == {"README.md"}
    old, new = before["README.md"].decode(), after["README.md"].decode()
    assert new.split("\n---\n", 1)[1] == old.split("\n---\n", 1)[1]
    assert new[: new.index("\n---\n")] == old[: old.index("\n---\n")] + "\nlicense: mit"


# The attack on the step (issue 50): each test failed on 8842a28 ------------------------------------------------


def _lora_adapter(model: str, folder: Path) -> str:
    """A seeded LoRA adapter of ``model`` (peft's), changing q_proj and v_proj."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    peft_model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32),
        LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]),
    )
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn_like(parameter) * 0.05)
    peft_model.save_pretrained(str(folder))
    return str(folder)


def test_lora_and_revision_references_are_renamed_in_all_three_files(bf16_models: ModelSet, tmp_path: Path) -> None:
    """Group 1: a real merge of ``BASE+ADAPTER`` and of ``model@rev``; the card's statistics row kept the local
    ``base+adapter`` path, and ``check`` then called the card another merge's."""
    coding, tool, memory = bf16_models.agents
    adapter = _lora_adapter(coding, tmp_path / "adapter")
    recipe = bf16_models.recipe("ram_plus")
    recipe["models"] = [{"model": f"{coding}+{adapter}"}, {"model": f"{tool}@main"}, {"model": memory}]
    out = tmp_path / "out"
    merge_in_process(recipe, str(out), lora_merge_cache=str(tmp_path / "lora-cache"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / name).write_text("{}", encoding="utf-8")
    ids = {bf16_models.base: "org/base", coding: "org/coder", adapter: "org/adapter", tool: "org/tool"}
    options = [f"--hub-id={path}={hub_id}" for path, hub_id in {**ids, memory: "org/memory"}.items()]
    assert check(out, *options, "--set-license", "mit") == (0, [MANIFEST_NOTE, "ready to upload"])
    for name in ("README.md", "mergekit_config.yml", "ram_statistics.json"):
        assert str(tmp_path) not in (text := (out / name).read_text(encoding="utf-8")), name
        assert os.path.dirname(bf16_models.base) not in text, name
    statistics = json.loads((out / "ram_statistics.json").read_text(encoding="utf-8"))
    assert [row["model"] for row in statistics["models"]] == ["org/coder+org/adapter", "org/tool", "org/memory"]
    assert "| org/coder+org/adapter |" in (out / "README.md").read_text(encoding="utf-8")
    before = snapshot(out)
    assert check(out, *options, "--set-license", "mit")[0] == 0 and snapshot(out) == before


def test_an_id_that_yaml_reads_as_a_date_stays_text(merged: Path, bf16_models: ModelSet) -> None:
    """Group 2: ``2024-01-01`` was written unquoted; the saved recipe then failed in mergekit-yaml
    (``datetime.date``). What is written reads back through mergekit's own loader as the same strings."""
    from mergekit.config import MergeConfiguration

    options = [option.replace("=org/base", "=2024-01-01") for option in hub_id_options(bf16_models)]
    assert check(merged, *options, "--set-license", "mit") == (0, [MANIFEST_NOTE, "ready to upload"])
    recipe = yaml.safe_load((merged / "mergekit_config.yml").read_text(encoding="utf-8"))
    assert MergeConfiguration.model_validate(recipe).base_model.model.path == "2024-01-01"
    card = (merged / "README.md").read_text(encoding="utf-8")
    assert "2024-01-01" in yaml.safe_load(card[4 : card.index("\n---\n", 4)])["base_model"]


def _naming_files(folder: Path) -> dict[str, bytes]:
    return {name: (folder / name).read_bytes() for name in ("README.md", "mergekit_config.yml", "ram_statistics.json")}


def _faulty(real: Any, renames: list[Any], at: int, fault: str) -> Any:
    """``real`` (a rename), counted in ``renames``: a full disk before the ``at``-th, or Ctrl-C after it."""

    def rename(*arguments: Any, **keywords: Any) -> Any:
        renames.append(arguments)
        if len(renames) == at and fault == "ENOSPC":
            raise OSError(errno.ENOSPC, "No space left on device")
        result = real(*arguments, **keywords)
        if len(renames) == at:
            os.kill(os.getpid(), signal.SIGINT)
        return result

    return rename


@pytest.mark.parametrize("fault", ["ENOSPC", "SIGINT"])
def test_the_three_files_change_together(
    merged: Path, bf16_models: ModelSet, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fault: str
) -> None:
    """Group 3: a fault at the second or third rename left the statistics new and the card old, and Ctrl-C ended
    in ``Aborted!`` (exit 1). At each rename of the step in turn, a full disk (before it) or Ctrl-C (after it): the
    three files are all old or all new, and Ctrl-C is one line with exit status 130."""
    whole = tmp_path / "whole"
    shutil.copytree(merged, whole)
    options = [*hub_id_options(bf16_models), "--set-license", "mit"]
    assert check(whole, *options)[0] == 0
    old, new = _naming_files(merged), _naming_files(whole)
    for at in range(1, 20):
        folder = tmp_path / f"at-{at}"
        shutil.copytree(merged, folder)
        renames: list[Any] = []
        with monkeypatch.context() as patched:
            patched.setattr(os, "rename", _faulty(os.rename, renames, at, fault))
            patched.setattr(os, "replace", _faulty(os.replace, renames, at, fault))
            result = run("check", str(folder), *options)
        assert _naming_files(folder) in (old, new), (fault, at)
        if len(renames) < at:  # the step ended before this rename: every rename was tried
            assert result.exit_code == 0 and _naming_files(folder) == new
            break
        assert len(result.stderr.splitlines()) == 1, result.output
        assert result.exit_code == (130 if fault == "SIGINT" else 1), result.output
    assert at > 2  # the three files took more than two renames


def test_a_card_edited_by_hand_is_refused(merged: Path, bf16_models: ModelSet) -> None:
    """Group 4: the card's text was rewritten word by word (``base`` in the user's prose became ``org/base``; a
    path before a full stop stayed). A card whose text is not what the merge wrote is refused; nothing written."""
    card = (merged / "README.md").read_text(encoding="utf-8")
    title = card.index("\n# ") + 1
    edited = card[:title] + f"Our base is {bf16_models.base}.\n\n" + card[title:]
    (merged / "README.md").write_text(edited, encoding="utf-8")
    before = snapshot(merged)
    assert refused(merged, *hub_id_options(bf16_models)) == (
        "Error: README.md's text is not what the merge wrote (edited since, or by another version): merge again to "
        "have it written for the Hub ids, or name them in it by hand; nothing was changed"
    )
    assert snapshot(merged) == before


def test_a_large_card_is_read_in_linear_time(merged: Path, bf16_models: ModelSet) -> None:
    """Group 5: the card's regex took 60 s on a 296 KB card and 85 s with 2,000 base_model entries."""
    card = (merged / "README.md").read_text(encoding="utf-8")
    body = card.index("\n# ") + 1
    quote = "The following YAML configuration was used to produce this model:\n\n```yaml\n"
    quotes = card[:body] + quote * (296_000 // len(quote)) + card[body:]  # unclosed quotes before the real one
    many = "".join(f"- ./models/model-{index}\n" for index in range(2000))
    for text in (quotes, quotes.replace("base_model: []\n", f"base_model:\n{many}")):
        (merged / "README.md").write_text(text, encoding="utf-8")
        started = time.perf_counter()
        assert check(merged)[0] == 1
        run("check", str(merged), *hub_id_options(bf16_models))
        assert time.perf_counter() - started < 10


def test_statistics_holding_an_infinite_number_are_one_line(merged: Path, bf16_models: ModelSet) -> None:
    """Group 6: a statistics file holding ``1e999`` ended the step in a 46-line ``ValueError`` traceback."""
    text = (merged / "ram_statistics.json").read_text(encoding="utf-8")
    (merged / "ram_statistics.json").write_text(text.replace('"lambda": ', '"lambda": 1e999, "x": ', 1))
    before = snapshot(merged)
    assert refused(merged, *hub_id_options(bf16_models)) == (
        f"Error: cannot change {merged}: ram_statistics.json is not the statistics file a merge writes "
        "(models.0.lambda: Input should be a finite number); fix it by hand or merge again"
    )
    assert snapshot(merged) == before


def test_a_killed_merges_folder_is_refused_with_what_clears_it(
    merged: Path, bf16_models: ModelSet, ram_plus_merge: Merged
) -> None:
    """Group 7: after a killed merge (its private folder left) and a successful merge, the step still refused, saying
    "a merge into it was killed ... merge into it again", which did not clear it. The refusal's advice clears it."""
    left = merged / ".mergekit-ram-0123456789abcdef"
    (left / "staged").mkdir(parents=True)  # what a kill mid-merge leaves
    merge_in_process(ram_plus_merge.recipe, str(merged))
    assert refused(merged, *hub_id_options(bf16_models)) == (
        f"Error: {merged} holds {left}, left by a merge that was killed (the files it wrote or moved aside): remove "
        "it once you have what you need, then run this again"
    )
    shutil.rmtree(left)
    assert check(merged, *hub_id_options(bf16_models))[0] == 1  # the licence is missing
    assert "org/base" in (merged / "mergekit_config.yml").read_text(encoding="utf-8")


def test_an_id_file_giving_a_folder_twice_is_refused(merged: Path, tmp_path: Path) -> None:
    """Group 8: a ``--hub-id-file`` with a duplicate key silently took the last value, where two ``--hub-id``
    flags are refused."""
    ids = tmp_path / "ids.yml"
    ids.write_text("./models/base: org/a\n./models/base: org/b\n", encoding="utf-8")
    result = run("check", str(merged), "--hub-id-file", str(ids))
    assert (result.exit_code, result.stderr.splitlines()[-1]) == (
        2,
        f"Error: Invalid value for '--hub-id-file': cannot read {ids} (it gives ./models/base twice: give each "
        "local folder one id)",
    )


def test_a_relative_folder_that_matches_nothing_names_where_it_was_looked_for(
    merged: Path, bf16_models: ModelSet, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 49, 5: a relative LOCAL is resolved from the folder the command runs in, as the merge's paths are."""
    monkeypatch.chdir(tmp_path)
    message = refused(merged, *hub_id_options(bf16_models), "--hub-id", "./models/agent=org/agent")
    assert message.startswith(
        f"Error: --hub-id ./models/agent=org/agent: {merged} names no model at ./models/agent (relative to "
        f"{tmp_path}, the folder the command runs in); its local models: "
    )
