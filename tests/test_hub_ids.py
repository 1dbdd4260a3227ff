"""The one step to the Hub (``mergekit-ram check OUT --hub-id LOCAL=ID``): how local folders are matched, what is
refused before anything is written, that a second run changes nothing; and the bounded YAML reader beneath it."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from mergekit_ram import bounded_yaml
from mergekit_ram.hub_ids import renamed_recipe
from mergekit_ram.published import Card, read_card
from tests.conftest import Merged, ModelSet
from tests.test_check import MANIFEST_NOTE, check, hub_id_options, refused, run, snapshot

RENAMES = {
    "/m/base": "org/base",
    "/m/coder": "org/coder",
    "/m/tool": "org/tool",
    "/m/memory": "org/memory",
    "/m/memory-lora": "org/memory-lora@0123abc",
}


def test_the_recipe_keeps_the_users_text() -> None:
    """Each reference replaced where the parser found it: comments, quotes, anchors, flow style and the
    tokenizer's own words kept; LoRA references and revisions as mergekit reads them."""
    recipe = """\
# my agents
merge_method: ram_plus
base_model: &base /m/base   # the base
models:
  - model: "/m/coder"
  - model: '/m/tool'
    parameters: {rho: 1.5}
  - model: /m/memory+/m/memory-lora@v1
  - model: {model: {path: /m/coder, revision: main}, override_architecture: Qwen2ForCausalLM}
slices:
  - sources:
      - {model: /m/coder, layer_range: [0, 2]}
      - model: *base
        layer_range: [0, 2]
tokenizer_source: base
tokenizer:
  source: union
  tokens:
    "<x>": {source: {kind: model_token, model: /m/coder, token: a}}
    "<y>": {source: /m/tool}
"""
    renamed = renamed_recipe(recipe, RENAMES)
    assert renamed == (recipe.replace("/m/memory-lora@v1", "org/memory-lora@0123abc").replace("/m/", "org/"))
    assert renamed_recipe(renamed, RENAMES) == renamed


def test_an_alias_shared_with_another_key_is_dumped() -> None:
    """The anchored text is also a value of another key: splicing would change that too, so the renamed recipe
    is dumped instead (comments lost), the other key as it was."""
    assert renamed_recipe("name: &n /m/coder  # mine\nmodels:\n- model: *n\n", RENAMES) == (
        "name: /m/coder\nmodels:\n- model: org/coder\n"
    )


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
        f"Error: --hub-id /nowhere/agent=org/agent: {merged} names no model at /nowhere/agent (its local models: "
        f"{bf16_models.base}, {coding}, {tool}, {memory}); nothing was changed"
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


# The bounded YAML reader -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[" * 65 + "]" * 65, "x nests lists or mappings more than 64 levels deep at line 1, column 65"),
        ("a: &a [*a]\n", "x has an alias inside the node it names, near line 1"),
        ("a: !!int abc\n", "x has a value that cannot be read (invalid literal for int() with base 10: 'abc')"),
        ("a: !!timestamp 2024-13-01\n", "x has a value that cannot be read (month must be in 1..12)"),
        ("a: [b\n", "x is not valid YAML (expected ',' or ']', but got '<stream end>' at line 2, column 1)"),
        ("a: 1\n---\nb: 2\n", "x holds 2 YAML documents; one is expected"),
        ("a: " + "b" * bounded_yaml.MAX_CHARACTERS, "x is 1,048,579 characters, more than the 1,048,576 read at most"),
    ],
)
def test_strangers_yaml_is_refused_in_one_line(text: str, message: str) -> None:
    with pytest.raises(bounded_yaml.UnreadableYaml) as refused_yaml:
        bounded_yaml.load_one(text, "x")
    assert str(refused_yaml.value) == message


def test_dates_are_text_and_aliases_within_the_limit_are_values() -> None:
    assert bounded_yaml.load_one("a: 2024-02-30\nb: &b [1, 2]\nc: *b\n", "x") == {
        "a": "2024-02-30",
        "b": [1, 2],
        "c": [1, 2],
    }


@pytest.mark.parametrize(
    ("card", "expected"),
    [
        ("---\nlicense: mit\n---\n# A\n", Card({"license": "mit"}, "# A\n")),
        ("---\r\nlicense: mit\r\n---\r\n# A\r\n", Card({"license": "mit"}, "# A\r\n", "\r\n")),
        ("\n---\nlicense: mit\n---", Card({"license": "mit"}, "")),
        ("---\n\n---\n# A\n", Card({}, "# A\n")),
        ("# A\n---\nlicense: mit\n---\n", Card(None, "# A\n---\nlicense: mit\n---\n")),
    ],
)
def test_front_matter_as_the_hub_finds_it(card: str, expected: Card) -> None:
    assert read_card(card) == expected
    if expected.metadata:
        assert read_card(expected.text()) == expected


def test_a_step_stopped_half_way_is_completed_by_running_it_again(
    merged: Path, bf16_models: ModelSet, tmp_path: Path
) -> None:
    """The statistics and the recipe rewritten, the card not (the step stopped before its last rename): the
    card's own quote of the recipe still names the folders, so running the step again completes it, to the
    bytes of an uninterrupted run."""
    whole = tmp_path / "whole"
    shutil.copytree(merged, whole)
    assert check(whole, *hub_id_options(bf16_models), "--set-license", "mit")[0] == 0
    for name in ("ram_statistics.json", "mergekit_config.yml"):
        shutil.copy(whole / name, merged / name)
    status, lines = check(merged)
    assert status == 1 and any(line.startswith("problem: README.md names local folders (") for line in lines)
    assert check(merged, *hub_id_options(bf16_models), "--set-license", "mit") == (
        0,
        [MANIFEST_NOTE, "ready to upload"],
    )
    assert snapshot(merged) == snapshot(whole)


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
    assert new.split("\n---\n", 1)[0] == old.split("\n---\n", 1)[0].replace("\ntags:", "\nlicense: mit\ntags:")
