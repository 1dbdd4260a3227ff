"""Recipe parameters: refusals that name the parameter, and pinned statistics."""

from __future__ import annotations

import glob
import os
from typing import Any

import pytest
import torch
from mergekit.config import MergeConfiguration
from mergekit.merge import run_merge
from mergekit.options import MergeOptions

from mergekit_ram import merge_state_dicts
from mergekit_ram.parameters import ParameterError
from tests import reference
from tests.conftest import ModelSet, load_statistics, load_weights, run_script, write_recipe


def merge(recipe: dict[str, Any], out: str) -> None:
    run_merge(MergeConfiguration.model_validate(recipe), out, options=MergeOptions(quiet=True))


@pytest.mark.parametrize(
    ("parameters", "model_parameters", "message"),
    [
        ({"r": -0.1}, None, "ram_plus: parameter 'r' in parameters must be a finite number >= 0; got -0.1"),
        ({"alpha": -2}, None, "parameter 'alpha' in parameters must be a finite number >= 0; got -2"),
        ({"epsilon": -1e-5}, None, "parameter 'epsilon' in parameters must be a finite number >= 0"),
        ({"epsilon": float("nan")}, None, "parameter 'epsilon' in parameters must be a finite number >= 0"),
        ({"rule": "tanh"}, None, "parameter 'rule' in parameters must be 'clip' (RAM+) or 'soft' (RAM+s); got 'tanh'"),
        ({"apha": 2.0}, None, "unknown parameter 'apha' in parameters (did you mean 'alpha'?); valid names: alpha"),
        ({"r": [{"filter": "mlp", "value": -1}, {"value": 0.1}]}, None, "parameter 'r' in parameters must be"),
        (None, {"lamda": 1.1}, "unknown parameter 'lamda' in models[1].parameters (did you mean 'lambda'?)"),
        (None, {"rho": -3}, "parameter 'rho' in models[1].parameters must be a finite number >= 0"),
    ],
)
def test_invalid_parameters_are_refused_before_anything_is_read(
    bf16_models: ModelSet, tmp_path, parameters, model_parameters, message: str
) -> None:
    recipe = bf16_models.recipe("ram_plus")
    if parameters is not None:
        recipe["parameters"] = parameters
    if model_parameters is not None:
        recipe["models"][1]["parameters"] = model_parameters
    out = str(tmp_path / "out")
    with pytest.raises(ParameterError) as error:
        merge(recipe, out)
    assert message in str(error.value)
    assert not glob.glob(os.path.join(out, "*.safetensors"))


def test_ram_accepts_only_epsilon(bf16_models: ModelSet, tmp_path) -> None:
    with pytest.raises(ParameterError, match="ram: unknown parameter 'r' in parameters; valid names: epsilon"):
        merge(bf16_models.recipe("ram", parameters={"r": 0.1}), str(tmp_path / "out"))


def test_r_must_be_one_value_for_the_whole_merge(bf16_models: ModelSet, tmp_path) -> None:
    recipe = bf16_models.recipe("ram_plus", parameters={"r": [{"filter": "mlp", "value": 0.2}, {"value": 0.1}]})
    with pytest.raises(ParameterError, match="parameter 'r' must be one value for the whole merge"):
        merge(recipe, str(tmp_path / "out"))


def test_the_command_line_shows_the_message(bf16_models: ModelSet, tmp_path) -> None:
    recipe = write_recipe(str(tmp_path / "r.yml"), bf16_models.recipe("ram_plus", parameters={"apha": 2}))
    completed = run_script("mergekit-yaml", recipe, str(tmp_path / "out"), check=False)
    assert completed.returncode != 0
    assert "unknown parameter 'apha' in parameters (did you mean 'alpha'?)" in completed.stderr
    assert not os.path.exists(str(tmp_path / "out" / "model.safetensors"))


@pytest.mark.parametrize("kind", ["rho", "lambda"])
def test_pinned_statistics_skip_the_prepass_and_reproduce(bf16_models: ModelSet, tmp_path, kind: str) -> None:
    computed = str(tmp_path / "computed")
    merge(bf16_models.recipe("ram_plus"), computed)
    figures = load_statistics(computed)["models"]

    pinned_recipe = bf16_models.recipe("ram_plus")
    for entry, stats in zip(pinned_recipe["models"], figures):
        entry["parameters"] = {kind: stats[kind] if stats[kind] is not None else 1e9}
    pinned = str(tmp_path / "pinned")
    merge(pinned_recipe, pinned)
    statistics = load_statistics(pinned)
    assert statistics["source"] == "merge"  # no pre-pass ran
    assert [m["pinned"] for m in statistics["models"]] == [kind] * 3
    assert [m["lambda"] for m in statistics["models"]] == [m["lambda"] for m in figures]
    assert [m["shared"] for m in statistics["models"]] == [m["shared"] for m in figures]
    expected = load_weights(computed)
    assert all(torch.equal(tensor, expected[name]) for name, tensor in load_weights(pinned).items())


def test_in_memory_api_refuses_bad_values(bf16_models: ModelSet) -> None:
    base = load_weights(bf16_models.base)
    with pytest.raises(ParameterError, match="parameter 'alpha' in merge_state_dicts arguments must be"):
        merge_state_dicts(base, [base], alpha=-1.0)
    with pytest.raises(ParameterError, match="rho pinned for unknown model 'coder'"):
        merge_state_dicts(base, {"coding": base}, rho={"coder": 1.0})


def test_pinned_lambda_applies_with_r_zero_on_every_path(bf16_models: ModelSet, tmp_path) -> None:
    """r = 0 makes unpinned lambdas 1; a pinned lambda still applies, in files and in memory."""
    recipe = bf16_models.recipe("ram_plus", parameters={"r": 0.0})
    recipe["models"][0]["parameters"] = {"lambda": 1.3}
    out = str(tmp_path / "out")
    merge(recipe, out)
    assert [m["lambda"] for m in load_statistics(out)["models"]] == [1.3, 1.0, 1.0]
    base = load_weights(bf16_models.base)
    finetunes = [load_weights(path) for path in bf16_models.agents]
    merged = load_weights(out)
    for name in ("model.layers.0.self_attn.q_proj.weight", "lm_head.weight"):
        expected = reference.merge(base[name], [ft[name] for ft in finetunes], 1e-5, [1.3, 1.0, 1.0])
        assert torch.equal(merged[name], expected.to(torch.bfloat16)), name
    in_memory, _ = merge_state_dicts(
        base, dict(zip(bf16_models.agents, finetunes)), r=0.0, lambda_={bf16_models.agents[0]: 1.3}
    )
    assert all(torch.equal(in_memory[name], merged[name]) for name in merged)
