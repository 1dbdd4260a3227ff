"""Recipes that would silently merge something else, the built-in switch, and the model card.

Refusals come before any model is read or the output folder created; the messages name
the key or model and the fix.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import yaml
from mergekit.config import MergeConfiguration
from mergekit.merge import run_merge
from mergekit.options import MergeOptions
from mergekit.scripts.multimerge import load_config
from mergekit.scripts.run_yaml import main as mergekit_yaml

from mergekit_ram.errors import InputError
from mergekit_ram.integration.recipes import read_stages
from mergekit_ram.integration.registration import BUILTIN_RAM_VARIABLE, ours, register_methods
from mergekit_ram.parameters import METHOD_NAMES, RecipeError
from mergekit_ram.published import merge_metadata, merged_card
from tests import reference
from tests.conftest import (
    BUILTIN_RAM_BF16_WRONG_ELEMENTS,
    Merged,
    ModelSet,
    command_refusal,
    load_statistics,
    load_weights,
    run_script,
    write_recipe,
)


def merge_yaml(recipe: dict[str, Any], out: str) -> None:
    """What mergekit-yaml does with a recipe file: validate it, pass its text along."""
    source = yaml.safe_dump(recipe, sort_keys=False)
    run_merge(MergeConfiguration.model_validate(yaml.safe_load(source)), out, MergeOptions(quiet=True), source)


# Unknown keys -----------------------------------------------------------------------

KEY_CASES = [
    (
        {"paramaters": {"r": 0.2}},
        "ram_plus recipe: unknown key 'paramaters' at the top level of the recipe, which mergekit would ignore "
        "(did you mean 'parameters'?); valid keys there: modules, slices, models, merge_method, base_model",
    ),
    (
        {"rule": "soft"},
        "unknown key 'rule' at the top level of the recipe, which mergekit would ignore: 'rule' is a parameter "
        "of ram_plus; set it under the top-level `parameters:`",
    ),
    (
        {"parameters": {"epsilon": [{"fliter": "mlp", "value": 1e-3}, {"value": 1e-5}]}},
        "unknown key 'fliter' in `parameters.epsilon[0]`, which mergekit would ignore (did you mean 'filter'?); "
        "valid keys there: value, filter",
    ),
]


@pytest.mark.parametrize(("extra", "message"), KEY_CASES)
def test_unknown_keys_are_refused(bf16_models: ModelSet, tmp_path, extra: dict[str, Any], message: str) -> None:
    out = str(tmp_path / "out")
    with pytest.raises(RecipeError) as error:
        merge_yaml(bf16_models.recipe("ram_plus", **extra), out)
    assert message in str(error.value)
    assert not os.path.exists(out)


def test_a_model_level_key_names_the_model_block(bf16_models: ModelSet, tmp_path) -> None:
    recipe = bf16_models.recipe("ram_plus")
    recipe["models"][1]["lambda"] = 1.3
    with pytest.raises(RecipeError, match=r"unknown key 'lambda' in `models\[1\]`, which mergekit would ignore: "):
        merge_yaml(recipe, str(tmp_path / "out"))
    with pytest.raises(RecipeError, match=r"set it under `models\[1\]\.parameters:`; valid keys there: model, param"):
        merge_yaml(recipe, str(tmp_path / "out"))


def test_other_methods_keep_mergekits_leniency(bf16_models: ModelSet) -> None:
    """Only mergekit-ram recipes are checked: a ties recipe with a stray key loads as before."""
    source = yaml.safe_dump(bf16_models.recipe("ties", paramaters={"density": 0.5}))
    configs, _ = load_config(source, "/tmp/unused")
    assert configs[None].merge_method == "ties"


def test_mergekit_multi_stages_depend_on_earlier_ones(bf16_models: ModelSet, tmp_path) -> None:
    """The probe reads a mergekit-multi file as mergekit-multi does: a model named like a stage is its output.
    (mergekit-multi validates each stage and drops unknown keys before run_merge sees it: they are mergekit's.)"""
    first = {"name": "stage-one", **bf16_models.recipe("ram_plus")}
    second = {**bf16_models.recipe("ram"), "models": [{"model": "stage-one"}]}
    path = tmp_path / "multi.yml"
    path.write_text(yaml.safe_dump_all([first, second], sort_keys=False), encoding="utf-8")
    stages = read_stages(str(path), "/tmp/unused")
    assert [stage.depends_on for stage in stages] == [(), ("stage-one",)]


def test_mergekit_yaml_refuses_a_misspelled_key(bf16_models: ModelSet, tmp_path) -> None:
    """Through mergekit-yaml's real command, in-process (its one-line output: tests/test_cli.py)."""
    recipe = write_recipe(str(tmp_path / "r.yml"), bf16_models.recipe("ram_plus", paramaters={"r": 0.2}))
    assert command_refusal(mergekit_yaml, recipe, str(tmp_path / "out")).startswith(
        "ram_plus recipe: unknown key 'paramaters' at the top level of "
        "the recipe, which mergekit would ignore (did you mean 'parameters'?)"
    )
    assert not os.path.exists(str(tmp_path / "out"))


# Each model once --------------------------------------------------------------------


def _spellings(models: ModelSet, tmp_path) -> dict[str, str]:
    agent = models.agents[0]
    link = str(tmp_path / "linked-agent")
    os.symlink(agent, link)
    relative = os.path.relpath(agent)
    return {
        "trailing slash": agent + "/",
        "./ relative": "./" + relative if not relative.startswith(".") else relative,
        "bare relative": relative,
        "symlink": link,
        "dot segments": os.path.join(os.path.dirname(agent), ".", os.path.basename(agent)),
    }


@pytest.mark.parametrize("spelling", ["trailing slash", "./ relative", "bare relative", "symlink", "dot segments"])
def test_the_same_finetune_twice_is_refused(bf16_models: ModelSet, tmp_path, spelling: str) -> None:
    recipe = bf16_models.recipe("ram_plus")
    other = _spellings(bf16_models, tmp_path)[spelling]
    recipe["models"].append({"model": other})
    out = str(tmp_path / "out")
    with pytest.raises(InputError) as error:
        merge_yaml(recipe, out)
    real = os.path.realpath(bf16_models.agents[0])
    assert str(error.value) == (
        f"{other} and {bf16_models.agents[0]} in `models` are the same model ({real}): "
        "list each fine-tuned model once (RAM would count its changes twice, all as shared)"
    )
    assert not os.path.exists(out)


def test_the_base_under_another_spelling_is_refused(bf16_models: ModelSet, tmp_path) -> None:
    recipe = bf16_models.recipe("ram")
    recipe["models"].append({"model": bf16_models.base + "/"})
    with pytest.raises(InputError, match="is also listed under `models` as .*base/: list only the fine-tuned models"):
        merge_yaml(recipe, str(tmp_path / "out"))
    sources = [{"model": path, "layer_range": [0, 2]} for path in [*bf16_models.agents, bf16_models.base]]
    sliced = {"merge_method": "ram", "base_model": bf16_models.base, "slices": [{"sources": sources}]}
    sources.append({"model": bf16_models.agents[1] + "/", "layer_range": [0, 2]})
    with pytest.raises(InputError, match=r"in `slices\[0\]\.sources` are the same model"):
        merge_yaml(sliced, str(tmp_path / "out"))
    sources[-1] = {"model": bf16_models.base + "/", "layer_range": [0, 2]}
    with pytest.raises(InputError, match=r"the base model .* is also listed under `slices\[0\]\.sources` as"):
        merge_yaml(sliced, str(tmp_path / "out"))


def test_mergekit_yaml_refuses_a_symlinked_duplicate(bf16_models: ModelSet, tmp_path) -> None:
    link = str(tmp_path / "same-agent")
    os.symlink(bf16_models.agents[1], link)
    recipe = bf16_models.recipe("ram_plus")
    recipe["models"].append({"model": link})
    assert command_refusal(mergekit_yaml, write_recipe(str(tmp_path / "r.yml"), recipe), str(tmp_path / "out")) == (
        f"{link} and {bf16_models.agents[1]} in `models` are the same model "
        f"({os.path.realpath(bf16_models.agents[1])}): list each fine-tuned model once (RAM would count its "
        "changes twice, all as shared)"
    )
    assert not os.path.exists(str(tmp_path / "out"))


def test_one_agent_spelt_two_ways_in_two_slices_is_one_agent(bf16_models: ModelSet, tmp_path) -> None:
    """``A1`` in one slice's sources, ``A1/`` in another's: one statistics row with the agent's own global rho and
    one lambda, the same bytes as the recipe spelling it one way (issue 44: two rows, rho 0.343 and 0.169)."""
    first, second, third = bf16_models.agents

    def sliced(agent_in_second_slice: str) -> dict[str, Any]:
        slices = []
        for layer, agent in ((0, first), (1, agent_in_second_slice)):
            sources = [{"model": path, "layer_range": [layer, layer + 1]} for path in (agent, second, third)]
            slices.append({"sources": [*sources, {"model": bf16_models.base, "layer_range": [layer, layer + 1]}]})
        return {"merge_method": "ram_plus", "base_model": bf16_models.base, "slices": slices, "dtype": "float32"}

    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    merge_yaml(sliced(first), one)
    merge_yaml(sliced(first + "/"), two)
    statistics = load_statistics(two)
    assert [m["model"] for m in statistics["models"]] == [first, second, third]
    assert statistics["models"] == load_statistics(one)["models"]
    assert all(tensor["models"] == [first, second, third] for tensor in statistics["tensors"])
    weights = load_weights(one)
    assert all(torch.equal(tensor, weights[name]) for name, tensor in load_weights(two).items())
    # the one rho over both slices' tensors, from an independent count
    base, agents = load_weights(bf16_models.base), [load_weights(path) for path in bf16_models.agents]
    shared = unique = 0
    for tensor in statistics["tensors"]:
        counts = reference.counts(base[tensor["name"]], [agent[tensor["name"]] for agent in agents], 1e-5)
        shared, unique = shared + counts.shared[0], unique + counts.unique[0]
    assert statistics["models"][0]["rho"] == reference.rho(shared, unique)


def test_a_second_entry_of_one_folder_with_an_override_is_refused(bf16_models: ModelSet, tmp_path) -> None:
    """The same folder listed again with ``override_architecture`` (issue 44: one entry dropped silently, the
    statistics listing two of three models): the same weights twice, refused as the same model in one line."""
    recipe = bf16_models.recipe("ram_plus")
    override = {"model": {"path": bf16_models.agents[0]}, "override_architecture": "LlamaForCausalLM"}
    recipe["models"].append({"model": override})
    out = str(tmp_path / "out")
    with pytest.raises(InputError) as error:
        merge_yaml(recipe, out)
    assert str(error.value) == (
        f"{bf16_models.agents[0]} (override_architecture LlamaForCausalLM) and {bf16_models.agents[0]} in `models` "
        f"are the same model ({os.path.realpath(bf16_models.agents[0])}): list each fine-tuned model once (RAM "
        "would count its changes twice, all as shared)"
    )
    assert not os.path.exists(out)
    recipe["models"] = [*recipe["models"][1:3], {"model": override}]  # listed once: merged, and in the statistics
    merge_yaml(recipe, out)
    assert [m["model"] for m in load_statistics(out)["models"]] == [*bf16_models.agents[1:], bf16_models.agents[0]]


# Local folders written like Hub ids ---------------------------------------------------


def _relative_models(models: ModelSet, root: str) -> dict[str, str]:
    """``models/base``, ``models/agent-0``... as links in ``root`` (the folder the command runs in)."""
    os.makedirs(os.path.join(root, "models"))
    named = {"base": models.base, **{f"agent-{index}": agent for index, agent in enumerate(models.agents)}}
    for name, target in named.items():
        os.symlink(target, os.path.join(root, "models", name))
    return {name: f"models/{name}" for name in named}


HUB_LIKE = (
    "model path models/base is a local folder written like a Hub id (org/name), which mergekit's model card would "
    "look up on the Hub once the merge is done: write it ./models/base"
)


def test_a_local_folder_written_like_a_hub_id_is_refused_before_the_merge(
    bf16_models: ModelSet, tmp_path, monkeypatch
) -> None:
    """mergekit's card writer asks the Hub about ``models/base`` after the whole merge (offline: a 74-line
    traceback); refused first, on every entry point, before the output folder is made."""
    monkeypatch.chdir(tmp_path)
    paths = _relative_models(bf16_models, str(tmp_path))
    recipe = {
        "merge_method": "ram_plus",
        "base_model": paths["base"],
        "models": [{"model": paths[f"agent-{index}"]} for index in range(len(bf16_models.agents))],
    }
    with pytest.raises(RecipeError) as refused:
        merge_yaml(recipe, str(tmp_path / "api"))
    assert str(refused.value) == HUB_LIKE
    path = write_recipe(str(tmp_path / "recipe.yml"), recipe)
    assert command_refusal(mergekit_yaml, path, str(tmp_path / "yaml")) == HUB_LIKE
    stages = ["--intermediate-dir", str(tmp_path / "stages"), "--out-path", str(tmp_path / "stages" / "final")]
    multi = run_script("mergekit-multi", path, *stages, check=False)
    assert multi.returncode == 1 and multi.stderr.strip().splitlines()[-1] == f"Error: {HUB_LIKE}"
    assert not any(os.path.exists(tmp_path / name) for name in ("api", "yaml", "stages/final"))
    agent = {
        **recipe,
        "base_model": f"./{paths['base']}",
        "models": [{"model": "./models/agent-0"}, {"model": "models/agent-1"}],
    }
    with pytest.raises(RecipeError, match="model path models/agent-1 is a local folder written like a Hub id"):
        merge_yaml(agent, str(tmp_path / "api"))


def test_written_as_a_local_path_it_merges_and_the_card_names_the_folder(
    bf16_models: ModelSet, tmp_path, monkeypatch
) -> None:
    monkeypatch.chdir(tmp_path)
    paths = _relative_models(bf16_models, str(tmp_path))
    recipe = {
        "merge_method": "ram",
        "base_model": f"./{paths['base']}",
        "models": [{"model": f"./{paths[f'agent-{index}']}"} for index in range(len(bf16_models.agents))],
    }
    merge_yaml(recipe, str(tmp_path / "out"))
    card = (tmp_path / "out" / "README.md").read_text(encoding="utf-8")
    assert "using ./models/base as a base" in card and "huggingface.co/models" not in card
    written = {**recipe, "base_model": paths["base"]}  # without a card, mergekit asks the Hub nothing
    run_merge(
        MergeConfiguration.model_validate(written),
        str(tmp_path / "no-card"),
        MergeOptions(quiet=True, write_model_card=False),
    )
    assert os.path.exists(tmp_path / "no-card" / "ram_statistics.json")


# MERGEKIT_RAM_BUILTIN_RAM -----------------------------------------------------------


def test_the_switch_keeps_mergekits_builtin_ram(monkeypatch, caplog) -> None:
    """Registered with the switch set (as at start-up): the built-in ``ram`` stays, ``ram_plus`` is ours; one
    warning says so. Without it, ours replaces the built-in."""
    import mergekit.merge_methods.registry as registry
    from mergekit.merge_methods import get, ram_merge

    for switch in ("1", ""):
        table = {name: method for name, method in registry._METHODS.items() if name not in METHOD_NAMES}
        monkeypatch.setattr(registry, "_METHODS", {**table, "ram": ram_merge})  # mergekit's, before registration
        monkeypatch.setenv(BUILTIN_RAM_VARIABLE, switch)
        caplog.clear()
        register_methods()
        assert (get("ram") is ram_merge) == (switch == "1")
        assert ours("ram_plus") is not None and (ours("ram") is None) == (switch == "1")
        warned = "MERGEKIT_RAM_BUILTIN_RAM=1: keeping mergekit's built-in 'ram' (arithmetic in the checkpoint dtype"
        assert (warned in caplog.text) == (switch == "1")


def test_the_switch_runs_the_builtin_and_ours_is_exact(
    bf16_models: ModelSet, upstream_ram_merge: Merged, tmp_path
) -> None:
    """Same recipe, same bf16 models: the built-in's bf16 arithmetic differs; ours equals the float32 reference."""
    from mergekit.merge_methods import ram_merge
    from mergekit.merge_methods.registry import _METHODS

    out = str(tmp_path / "builtin")
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(_METHODS, "ram", ram_merge)  # as the switch registers
        completed = run_script("mergekit-yaml", upstream_ram_merge.recipe, out)
    assert "ignores parameter 'weight'" not in completed.stderr  # mergekit's own path, unchecked
    assert not os.path.exists(os.path.join(out, "ram_statistics.json"))
    assert "mergekit-ram" not in open(os.path.join(out, "README.md"), encoding="utf-8").read()

    base = load_weights(bf16_models.base)
    finetunes = [load_weights(path) for path in bf16_models.agents]
    builtin, ours = load_weights(out), load_weights(upstream_ram_merge.out)
    differing = 0
    for name, tensor in ours.items():
        expected = reference.merge(base[name], [ft[name] for ft in finetunes], 1e-5, [1.0, 1.0, 1.0])
        assert torch.equal(tensor, expected.to(torch.bfloat16)), name
        differing += int((builtin[name] != tensor).sum())
    assert differing == BUILTIN_RAM_BF16_WRONG_ELEMENTS  # the built-in's bfloat16 arithmetic, as without a dtype


# The model card ---------------------------------------------------------------------


def _front_matter(card: str) -> dict[str, Any]:
    assert card.startswith("---\n")
    return yaml.safe_load(card[4 : card.index("\n---\n", 4)])


def test_the_card_says_how_to_reproduce_a_ram_merge(upstream_ram_merge: Merged) -> None:
    card = open(os.path.join(upstream_ram_merge.out, "README.md"), encoding="utf-8").read()
    assert _front_matter(card)["tags"] == ["mergekit", "merge", "mergekit-ram"]
    assert "## Reproducing this merge" in card
    assert (
        "The `ram` merge method comes from [mergekit-ram](https://github.com/mergekit-ram/mergekit-ram), a plugin "
        "for mergekit" in card
    )
    for install in (
        "`pip install .`",
        "`pip install dist/mergekit_ram-*.whl`",
        "once released: `pip install mergekit-ram`",
    ):
        assert install in card
    assert "run `mergekit-yaml mergekit_config.yml <output folder>`" in card
    assert os.path.exists(os.path.join(upstream_ram_merge.out, "mergekit_config.yml"))
    assert (
        "Without mergekit-ram, mergekit silently runs its own built-in `ram` instead: it computes in the "
        "checkpoints' dtype, so on bfloat16 or float16 checkpoints its numbers differ from this model's"
    ) in card
    assert card.index("## Reproducing this merge") < card.index("## RAM statistics")


def test_card_tag_is_added_once() -> None:
    metadata = {"base_model": [], "library_name": "transformers", "tags": ["mergekit", "merge"]}
    tagged = merge_metadata(metadata, "mergekit-ram")
    assert tagged == {**metadata, "tags": ["mergekit", "merge", "mergekit-ram"]}
    assert merge_metadata(tagged, "mergekit-ram") == tagged
    assert merge_metadata({"library_name": "x"}, "t") == {"library_name": "x", "tags": ["t"]}


def test_card_lists_models_in_one_order_and_says_it_is_a_merge() -> None:
    """mergekit builds both lists from a set (their order changed with the hash seed); the Hub reads
    ``base_model_relation: merge`` for a model whose ``base_model`` lists the models merged."""
    card = (
        "---\nbase_model:\n- org/tool\n- org/base\n- org/code\n- org/base\nlibrary_name: transformers\n"
        "tags:\n- mergekit\n---\n# out\n\n### Models Merged\n\nThe following models were included in the merge:\n"
        "* [org/tool](https://huggingface.co/org/tool)\n* /local/b\n* [org/code](https://huggingface.co/org/code)\n"
        "\n### Configuration\n\n* not a model\n* a\n"
    )
    assert str(merged_card(card, None)) == (
        "---\nbase_model:\n- org/base\n- org/code\n- org/tool\nlibrary_name: transformers\ntags:\n- mergekit\n"
        "base_model_relation: merge\n---\n# out\n\n### Models Merged\n\nThe following models were included in "
        "the merge:\n* /local/b\n* [org/code](https://huggingface.co/org/code)\n* [org/tool](https://huggingface.co/org/tool)\n"
        "\n### Configuration\n\n* not a model\n* a\n"
    )


def test_statistics_parameters_round_trip(upstream_ram_merge: Merged) -> None:
    """The card's figures are the JSON's (one object renders both)."""
    statistics = load_statistics(upstream_ram_merge.out)
    card = open(os.path.join(upstream_ram_merge.out, "README.md"), encoding="utf-8").read()
    assert "Merged with `ram` (`epsilon` = 1e-05)" in card
    assert [m["lambda"] for m in statistics["models"]] == [1.0, 1.0, 1.0]
