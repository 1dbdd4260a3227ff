"""ram_ties and ram_unique (the authors' arm-ties and arm-unique) through every entry point, against
the independent reference (tests/reference.py, written from the definitions), bit for bit.

Models: the shared session models, whose shared and unique sets are known by construction
(tests/conftest.py). The rules' corner cases (ties at the trimming threshold, shared positions
where every entry is trimmed, sign ties, float64) are tested on the kernel in tests/test_kernel.py;
here every path a user takes is checked to reach that kernel with the right settings.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Sequence

import pytest
import torch
import yaml
from mergekit.merge_methods import merge_state_dicts as mergekit_merge_state_dicts
from mergekit.scripts.merge_raw_pytorch import main as mergekit_pytorch

import mergekit_ram
from mergekit_ram.integration.recipes import check_recipe
from mergekit_ram.parameters import ParameterError
from mergekit_ram.probe import probe_config
from tests import reference
from tests.conftest import ModelSet, load_statistics, load_weights, merge_in_process, run_script, write_recipe
from tests.test_merge_exact import EPSILON, assert_same_weights, designed_counts

SCALES = {"full strength": [1.0, 0.0, 0.0], "divided by N": [1 / 3, 0.0, 0.0], "every agent": [1.0, 1.0, 1.0]}


def expected_ties(models: ModelSet, density: float, r: float = 0.0) -> tuple[dict[str, torch.Tensor], list[float]]:
    """ram_ties per the definitions: global rho from every tensor, lambda = 1 + r * clip(rho, 0, 2)."""
    base, finetunes = load_weights(models.base), [load_weights(path) for path in models.agents]
    shared, unique = [0] * len(finetunes), [0] * len(finetunes)
    for name in base:
        counts = reference.counts(base[name], [ft[name] for ft in finetunes], EPSILON)
        shared = [a + b for a, b in zip(shared, counts.shared)]
        unique = [a + b for a, b in zip(unique, counts.unique)]
    lambdas = [reference.lambda_clip(reference.rho(s, u), r, 2.0) for s, u in zip(shared, unique)]
    merged = {
        name: reference.ties_merge(tensor, [ft[name] for ft in finetunes], EPSILON, density, lambdas).to(tensor.dtype)
        for name, tensor in base.items()
    }
    return merged, lambdas


def expected_unique(models: ModelSet, scales: Sequence[float]) -> dict[str, torch.Tensor]:
    base, finetunes = load_weights(models.base), [load_weights(path) for path in models.agents]
    return {
        name: reference.unique_merge(tensor, [ft[name] for ft in finetunes], EPSILON, scales).to(tensor.dtype)
        for name, tensor in base.items()
    }


def unique_recipe(models: ModelSet, scales: Sequence[float]) -> dict[str, Any]:
    recipe = models.recipe("ram_unique")
    for entry, scale in zip(recipe["models"], scales):
        entry["parameters"] = {"scale": scale}
    return recipe


@pytest.mark.parametrize("density", [0.1, 0.5, 1.0])
@pytest.mark.parametrize("dtype_fixture", ["fp32_models", "bf16_models"])
def test_ram_ties_equals_reference(
    dtype_fixture: str, density: float, request: pytest.FixtureRequest, tmp_path
) -> None:
    """run_merge, the authors' mode (r = 0, every lambda 1): no pre-pass, counts from the merge."""
    models: ModelSet = request.getfixturevalue(dtype_fixture)
    out = str(tmp_path / "out")
    merge_in_process(models.recipe("ram_ties", parameters={"density": density}), out)
    expected, lambdas = expected_ties(models, density)
    assert_same_weights(load_weights(out), expected)
    statistics = load_statistics(out)
    assert statistics["source"] == "merge" and lambdas == [1.0, 1.0, 1.0]
    assert statistics["parameters"] == {"epsilon": EPSILON, "density": density, "r": 0.0, "alpha": 2.0, "rule": "clip"}
    assert [(m["shared"], m["unique"]) for m in statistics["models"]] == list(zip(*designed_counts(models)))
    assert [m["lambda"] for m in statistics["models"]] == [1.0, 1.0, 1.0]


def test_ram_ties_with_rescaling_runs_the_prepass(bf16_models: ModelSet, tmp_path) -> None:
    """r > 0: the same global rho and lambda as ram_plus, applied to the unique updates."""
    out = str(tmp_path / "out")
    merge_in_process(bf16_models.recipe("ram_ties", parameters={"density": 0.1, "r": 0.1}), out)
    expected, lambdas = expected_ties(bf16_models, 0.1, r=0.1)
    assert_same_weights(load_weights(out), expected)
    statistics = load_statistics(out)
    assert statistics["source"] == "pre-pass"
    assert [m["lambda"] for m in statistics["models"]] == lambdas and lambdas[0] == 1.2


@pytest.mark.parametrize("arm", list(SCALES))
@pytest.mark.parametrize("dtype_fixture", ["fp32_models", "bf16_models"])
def test_ram_unique_equals_reference(dtype_fixture: str, arm: str, request: pytest.FixtureRequest, tmp_path) -> None:
    """The paper's Figure 3 arms: one agent's unique region at 1 and at 1/N, the others' at 0; and all at 1."""
    models: ModelSet = request.getfixturevalue(dtype_fixture)
    out = str(tmp_path / "out")
    merge_in_process(unique_recipe(models, SCALES[arm]), out)
    assert_same_weights(load_weights(out), expected_unique(models, SCALES[arm]))
    statistics = load_statistics(out)
    assert [m["lambda"] for m in statistics["models"]] == SCALES[arm]  # what was applied: each scale
    assert [m["pinned"] for m in statistics["models"]] == ["scale"] * 3
    assert [(m["shared"], m["unique"]) for m in statistics["models"]] == list(zip(*designed_counts(models)))


def test_the_console_scripts(bf16_models: ModelSet, tmp_path) -> None:
    """mergekit-multi (one stage of each) and mergekit-yaml write what run_merge writes, byte for byte."""
    ties = bf16_models.recipe("ram_ties", parameters={"density": 0.5})
    unique = unique_recipe(bf16_models, SCALES["divided by N"])
    multi = str(tmp_path / "stages.yml")
    with open(multi, "w", encoding="utf-8") as handle:
        yaml.safe_dump_all([{"name": "ties", **ties}, {"name": "unique", **unique}], handle, sort_keys=False)
    run_script("mergekit-multi", multi, "-I", str(tmp_path / "stages"))
    run_script("mergekit-yaml", write_recipe(str(tmp_path / "ties.yml"), ties), str(tmp_path / "yaml"))
    expected, _ = expected_ties(bf16_models, 0.5)
    for out in (tmp_path / "stages" / "ties", tmp_path / "yaml"):
        assert_same_weights(load_weights(str(out)), expected)
        assert load_statistics(str(out))["method"] == "ram_ties"
    assert_same_weights(
        load_weights(str(tmp_path / "stages" / "unique")), expected_unique(bf16_models, SCALES["divided by N"])
    )
    with open(tmp_path / "yaml" / "README.md", encoding="utf-8") as handle:
        card = handle.read()
    assert "## RAM statistics" in card and "Without mergekit-ram, mergekit refuses `ram_ties`" in card


def _pytorch(models: ModelSet, recipe: dict[str, Any], out: str) -> None:
    files = {
        **recipe,
        "base_model": os.path.join(models.base, "model.safetensors"),
        "models": [{**entry, "model": os.path.join(entry["model"], "model.safetensors")} for entry in recipe["models"]],
    }
    mergekit_pytorch.main(args=[write_recipe(out + ".yml", files), out], standalone_mode=False)


def test_mergekit_pytorch(bf16_models: ModelSet, tmp_path) -> None:
    _pytorch(bf16_models, bf16_models.recipe("ram_ties"), str(tmp_path / "ties"))
    assert_same_weights(load_weights(str(tmp_path / "ties")), expected_ties(bf16_models, 0.1)[0])
    _pytorch(bf16_models, unique_recipe(bf16_models, SCALES["full strength"]), str(tmp_path / "unique"))
    assert_same_weights(load_weights(str(tmp_path / "unique")), expected_unique(bf16_models, SCALES["full strength"]))


def _state_dicts(models: ModelSet) -> dict[str, dict[str, torch.Tensor]]:
    return {"base": load_weights(models.base), **{f"agent{i}": load_weights(p) for i, p in enumerate(models.agents)}}


def test_both_in_memory_apis(bf16_models: ModelSet) -> None:
    """mergekit's merge_state_dicts with the plugin registered, and mergekit_ram's with the statistics."""
    states = _state_dicts(bf16_models)
    merged = mergekit_merge_state_dicts(states, "ram_ties", base="base", parameters={"density": 0.5})
    assert_same_weights(merged, expected_ties(bf16_models, 0.5)[0])
    scales = {"agent0": 1 / 3, "agent1": 0.0, "agent2": 0.0}
    merged, statistics = mergekit_ram.merge_state_dicts(states, "ram_unique", base="base", parameters={"scale": scales})
    assert_same_weights(merged, expected_unique(bf16_models, SCALES["divided by N"]))
    assert [model.lambda_ for model in statistics.models] == SCALES["divided by N"]


def test_the_probe(bf16_models: ModelSet) -> None:
    """The probe's counts are the merge's: each model's shared and unique sets as built."""
    from mergekit.config import MergeConfiguration
    from mergekit.options import MergeOptions

    for recipe in (bf16_models.recipe("ram_ties"), unique_recipe(bf16_models, SCALES["full strength"])):
        statistics = probe_config(MergeConfiguration.model_validate(recipe), MergeOptions(quiet=True))
        assert [(m.shared, m.unique) for m in statistics.models] == list(zip(*designed_counts(bf16_models)))


@pytest.mark.parametrize(
    ("method", "where", "parameters", "message"),
    [
        ("ram_ties", None, {"density": 0.0}, "parameter 'density' in parameters must be a number in (0, 1]"),
        ("ram_ties", None, {"density": 1.5}, "parameter 'density' in parameters must be a number in (0, 1]"),
        ("ram_ties", None, {"densty": 0.5}, "unknown parameter 'densty' in parameters (did you mean 'density'?)"),
        ("ram_ties", 0, {"density": 0.5}, "parameter 'density' in models[0].parameters is set for one model"),
        ("ram_unique", None, {"scale": -1.0}, "parameter 'scale' in parameters must be a finite number >= 0"),
        ("ram_unique", 1, {"scael": 1.0}, "unknown parameter 'scael' in models[1].parameters (did you mean 'scale'?)"),
    ],
)
def test_recipe_checks(
    bf16_models: ModelSet, method: str, where: Optional[int], parameters: dict[str, Any], message: str
) -> None:
    from mergekit.config import MergeConfiguration

    recipe = bf16_models.recipe(method)
    if where is None:
        recipe["parameters"] = parameters
    else:
        recipe["models"][where]["parameters"] = parameters
    with pytest.raises(ParameterError) as refused:
        check_recipe(method, MergeConfiguration.model_validate(recipe))
    assert message in str(refused.value)


def test_another_methods_parameter_is_warned_about_and_ignored(bf16_models: ModelSet, caplog, tmp_path) -> None:
    """A ties recipe switched to ram_ties keeps `weight` on its models: ignored, with a warning."""
    recipe = bf16_models.recipe("ram_ties")
    for entry in recipe["models"]:
        entry["parameters"] = {"weight": 0.5}
    from mergekit.config import MergeConfiguration

    check_recipe("ram_ties", MergeConfiguration.model_validate(recipe))
    assert "ram_ties ignores parameter 'weight' (in models[0].parameters, models[1].parameters" in caplog.text
