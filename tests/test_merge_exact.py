"""ram / ram_plus against the independent reference.

The merges run through mergekit's run_merge in this process, the plugin registered as users get
it; ``test_mergekit_yaml_merges_equal_the_reference`` checks the shared merges of the real
mergekit-yaml (tests/conftest.py) the same way, and the built-in ``ram`` runs in mergekit-yaml
with the plugin switched off.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from mergekit.scripts.run_yaml import main as mergekit_yaml

from mergekit_ram.synthetic import build_base, sparse_agents, tiny_config, write_checkpoint
from tests import reference
from tests.conftest import (
    BF16_MODELS_ELEMENTS,
    BUILTIN_RAM_BF16_WRONG_ELEMENTS,
    Merged,
    ModelSet,
    command_refusal,
    load_statistics,
    load_weights,
    merge_in_process,
    mergekit_alone,
    run_script,
    write_recipe,
)

EPSILON = 1e-5


def reference_merge(models: ModelSet, epsilon: float, lambda_of) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Global counts over every tensor, lambdas from them, then the per-element rule."""
    base = load_weights(models.base)
    finetunes = [load_weights(path) for path in models.agents]
    shared = [0] * len(finetunes)
    unique = [0] * len(finetunes)
    for name in base:
        counts = reference.counts(base[name], [ft[name] for ft in finetunes], epsilon)
        shared = [a + b for a, b in zip(shared, counts.shared)]
        unique = [a + b for a, b in zip(unique, counts.unique)]
    lambdas = [lambda_of(reference.rho(s, u)) for s, u in zip(shared, unique)]
    merged = {
        name: reference.merge(tensor, [ft[name] for ft in finetunes], epsilon, lambdas).to(tensor.dtype)
        for name, tensor in base.items()
    }
    return merged, {"shared": shared, "unique": unique, "lambdas": lambdas}


def designed_counts(models: ModelSet) -> tuple[list[int], list[int]]:
    """Shared and unique counts straight from the masks the agents were built from."""
    shared = [0] * len(models.agents)
    unique = [0] * len(models.agents)
    for mask in models.design.masks.values():
        overlap = mask.sum(0)
        for index in range(len(models.agents)):
            shared[index] += int((mask[index] & (overlap >= 2)).sum())
            unique[index] += int((mask[index] & (overlap == 1)).sum())
    return shared, unique


def assert_same_weights(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert set(actual) == set(expected)
    for name, tensor in expected.items():
        assert actual[name].dtype == tensor.dtype, name
        assert torch.equal(actual[name], tensor), f"{name}: {(actual[name] != tensor).sum()} elements differ"


@pytest.mark.parametrize("dtype_fixture", ["fp32_models", "bf16_models"])
@pytest.mark.parametrize("rule", ["clip", "soft"])
def test_ram_plus_equals_reference(dtype_fixture: str, rule: str, request: pytest.FixtureRequest, tmp_path) -> None:
    models: ModelSet = request.getfixturevalue(dtype_fixture)
    recipe = models.recipe("ram_plus", parameters={"r": 0.1, "alpha": 2.0, "epsilon": EPSILON, "rule": rule})
    out = str(tmp_path / "out")
    merge_in_process(recipe, out)
    assert_ram_plus_equals_reference(models, out, rule)


def assert_ram_plus_equals_reference(models: ModelSet, out: str, rule: str) -> None:
    """The merge in ``out`` (r = 0.1, alpha = 2, epsilon 1e-5) against the reference, weights and statistics."""
    if rule == "clip":
        expected, figures = reference_merge(models, EPSILON, lambda rho: reference.lambda_clip(rho, 0.1, 2.0))
    else:
        expected, figures = reference_merge(models, EPSILON, lambda rho: reference.lambda_soft(rho, 0.1))
    assert_same_weights(load_weights(out), expected)

    statistics = load_statistics(out)
    assert statistics["source"] == "pre-pass"
    assert [m["shared"] for m in statistics["models"]] == figures["shared"] == designed_counts(models)[0]
    assert [m["unique"] for m in statistics["models"]] == figures["unique"] == designed_counts(models)[1]
    assert [m["lambda"] for m in statistics["models"]] == figures["lambdas"]
    if rule == "clip":
        # The coding agent's rho is far above alpha (about 15): lambda is clipped to 1 + r * alpha.
        # The other two stay under it: lambda = 1 + r * rho, from the counts the models were built with.
        assert figures["lambdas"][0] == 1.2
        rhos = [shared / unique for shared, unique in zip(*designed_counts(models))]
        assert rhos[0] > 2.0 and all(rho < 2.0 for rho in rhos[1:])
        assert figures["lambdas"][1:] == [1 + 0.1 * rho for rho in rhos[1:]]


@pytest.mark.parametrize("dtype_fixture", ["fp32_models", "bf16_models"])
def test_ram_equals_reference(dtype_fixture: str, request: pytest.FixtureRequest, tmp_path) -> None:
    models: ModelSet = request.getfixturevalue(dtype_fixture)
    out = str(tmp_path / "out")
    merge_in_process(models.recipe("ram"), out)
    assert_ram_equals_reference(models, out)


def assert_ram_equals_reference(models: ModelSet, out: str) -> None:
    expected, figures = reference_merge(models, EPSILON, lambda rho: 1.0)
    assert_same_weights(load_weights(out), expected)
    statistics = load_statistics(out)
    assert statistics["source"] == "merge"  # counted during the merge: no pre-pass for RAM
    assert [m["unique"] for m in statistics["models"]] == figures["unique"]
    assert [m["lambda"] for m in statistics["models"]] == [1.0, 1.0, 1.0]


def test_mergekit_yaml_merges_equal_the_reference(
    bf16_models: ModelSet, ram_plus_merge: Merged, ram_merge: Merged
) -> None:
    """The real mergekit-yaml (the start-up hook registers the plugin): the shared bfloat16 merges of
    ``recipe("ram_plus")`` (defaults r = 0.1, alpha = 2, epsilon 1e-5, clip) and ``recipe("ram")``."""
    assert_ram_plus_equals_reference(bf16_models, ram_plus_merge.out, "clip")
    assert_ram_equals_reference(bf16_models, ram_merge.out)


def test_global_rho_differs_from_tensor_local(tmp_path) -> None:
    """Agent 0's changes are all shared in MLP weights and all unique elsewhere.

    Per tensor its rho is inf or 0 (ramplus_tl's view); over the whole model it is about
    1. ram_plus must scale agent 0's unique updates by the global lambda everywhere.
    """
    config = tiny_config("llama", hidden_size=32, intermediate_size=48, num_layers=2, vocab_size=64)
    base = build_base(str(tmp_path / "base"), config, dtype=torch.float32, seed=5)
    mlp = {name: t for name, t in base.items() if ".mlp." in name}
    rest = {name: t for name, t in base.items() if ".mlp." not in name}
    shared_part = sparse_agents(mlp, {(0, 1): 0.3, (1,): 0.2}, seed=6)  # agent 0 only shared here
    unique_part = sparse_agents(rest, {(0,): 0.3 * 21 / 36, (1,): 0.2}, seed=7)  # agent 0 only unique here
    paths = []
    for index in range(2):
        path = str(tmp_path / f"agent{index}")
        write_checkpoint(
            path, {**shared_part.states[index], **unique_part.states[index]}, config_source=str(tmp_path / "base")
        )
        paths.append(path)
    recipe = {
        "merge_method": "ram_plus",
        "base_model": str(tmp_path / "base"),
        "models": [{"model": p} for p in paths],
        "parameters": {"r": 0.2, "alpha": 5.0},
    }
    out = str(tmp_path / "out")
    merge_in_process(recipe, out)
    statistics = load_statistics(out)
    agent0 = statistics["models"][0]
    global_lambda = reference.lambda_clip(reference.rho(agent0["shared"], agent0["unique"]), 0.2, 5.0)
    assert (agent0["shared"], agent0["unique"]) == (2835, 1800)  # seeded: rho about 1.6 over the whole model
    assert agent0["lambda"] == global_lambda

    merged = load_weights(out)
    name = "model.layers.0.self_attn.q_proj.weight"  # agent 0 is all unique here: local rho = 0
    base_t, ft0, ft1 = base[name], load_weights(paths[0])[name], load_weights(paths[1])[name]
    only0 = ((ft0 - base_t).abs() > EPSILON) & ((ft1 - base_t).abs() <= EPSILON)
    assert int(only0.sum()) == 191  # seeded, measured once
    tau = ft0 - base_t
    expected = base_t + torch.tensor(global_lambda, dtype=torch.float32) * tau
    assert torch.equal(merged[name][only0], expected[only0])
    tensor_local = base_t + tau  # lambda = 1 + r * clip(0, 0, alpha) = 1
    assert not torch.equal(merged[name][only0], tensor_local[only0])


def test_plugin_ram_matches_builtin_ram_in_float32(bf16_models: ModelSet, builtin_ram_merge: Merged, tmp_path) -> None:
    """Parity with mergekit's built-in ram run with dtype: float32; in bfloat16 the built-in is off."""
    recipe32 = bf16_models.recipe("ram", dtype="float32")
    ours = str(tmp_path / "ours")
    builtin = str(tmp_path / "builtin")
    merge_in_process(recipe32, ours)
    with mergekit_alone():
        run_script("mergekit-yaml", write_recipe(str(tmp_path / "r32b.yml"), recipe32), builtin)
    assert not os.path.exists(os.path.join(builtin, "ram_statistics.json"))  # really the built-in
    ours_w, builtin_w = load_weights(ours), load_weights(builtin)
    for name, tensor in builtin_w.items():
        torch.testing.assert_close(ours_w[name], tensor, rtol=2e-7, atol=1e-7)

    # The built-in on the bfloat16 models without a dtype (the shared merge of recipe("ram")).
    expected, _ = reference_merge(bf16_models, EPSILON, lambda rho: 1.0)
    builtin_bf16 = load_weights(builtin_ram_merge.out)
    wrong = sum(int((builtin_bf16[n].to(torch.bfloat16) != t).sum()) for n, t in expected.items())
    assert sum(t.numel() for t in expected.values()) == BF16_MODELS_ELEMENTS
    assert wrong > 0, "the built-in ram computes in bfloat16 and should differ from the exact result"
    assert wrong == BUILTIN_RAM_BF16_WRONG_ELEMENTS


def constant_models(root: str, dtype: torch.dtype, base_value: float, changes: list) -> ModelSet:
    """A base filled with ``base_value`` and fine-tunes from ``changes(name, base) -> state``."""
    config = tiny_config("llama", hidden_size=32, intermediate_size=48, num_layers=2, vocab_size=64)
    shapes = build_base(os.path.join(root, "base"), config, dtype=dtype, seed=1)
    base = {name: torch.full_like(tensor, base_value) for name, tensor in shapes.items()}
    write_checkpoint(os.path.join(root, "base"), base)  # over the random weights; the config stays
    agents = []
    for index, change in enumerate(changes):
        path = os.path.join(root, f"agent{index}")
        write_checkpoint(
            path, {name: change(tensor) for name, tensor in base.items()}, config_source=os.path.join(root, "base")
        )
        agents.append(path)
    return ModelSet(base=os.path.join(root, "base"), agents=agents, design=None)  # type: ignore[arg-type]


def every_other(value: float):
    def change(tensor: torch.Tensor) -> torch.Tensor:
        changed = tensor.clone().reshape(-1)
        changed[::2] = value
        return changed.view(tensor.shape)

    return change


def merged_against_reference(
    models: ModelSet, out: str, lambdas_from_statistics: bool = True
) -> dict[str, torch.Tensor]:
    """The written weights, each asserted equal to the reference computed from the checkpoints."""
    merged = load_weights(out)
    base = load_weights(models.base)
    finetunes = [load_weights(path) for path in models.agents]
    lambdas = [m["lambda"] for m in load_statistics(out)["models"]]
    for name, tensor in base.items():
        expected = reference.merge(tensor, [ft[name] for ft in finetunes], EPSILON, lambdas)
        assert torch.equal(merged[name], expected.to(merged[name].dtype)), name
    return merged


@pytest.mark.parametrize("method", ["ram", "ram_plus"])
def test_out_dtype_float32_rounds_once(method: str, tmp_path) -> None:
    """bfloat16 base 1, A = 1 + 2**-7 everywhere, B = 1 + 2**-6 on every other element."""
    models = constant_models(
        str(tmp_path), torch.bfloat16, 1.0, [lambda t: torch.full_like(t, 1 + 2**-7), every_other(1 + 2**-6)]
    )
    out = str(tmp_path / "out")
    merge_in_process(models.recipe(method, out_dtype="float32"), out)
    merged = merged_against_reference(models, out)
    weight = merged["model.layers.0.mlp.up_proj.weight"].reshape(-1)
    assert weight.dtype == torch.float32
    assert weight[0].item() == 1.01171875  # not bfloat16's 1.015625
    # A alone: 1 + lambda_A * 2**-7 (lambda 1 for ram; rho_A = 1 -> 1 + 0.1 * 1 for ram_plus)
    assert weight[1].item() == (1.0078125 if method == "ram" else torch.tensor(1 + 1.1 * 2**-7).item())


def test_float64_checkpoints_merge_in_float64(tmp_path) -> None:
    """`dtype: float64` on float64 checkpoints: unchanged elements exact, changed ones the float64 result."""
    models = constant_models(str(tmp_path), torch.float64, 1.000000000001, [every_other(1.25), every_other(1.5)])
    recipe = models.recipe("ram_plus", dtype="float64")  # every change shared: the mean
    out = str(tmp_path / "out")
    merge_in_process(recipe, out)
    merged = merged_against_reference(models, out)
    weight = merged["model.norm.weight"]
    assert weight.dtype == torch.float64
    assert weight[1::2].tolist() == [1.000000000001] * 16
    assert weight[0].item() == 1.000000000001 + ((1.25 - 1.000000000001) + (1.5 - 1.000000000001)) / 2


def test_float16_cast_overflow_names_the_recipe_dtype(tmp_path) -> None:
    models = constant_models(str(tmp_path), torch.bfloat16, 70000.0, [every_other(1.0)])
    out = str(tmp_path / "out")
    recipe = write_recipe(str(tmp_path / "r.yml"), models.recipe("ram", dtype="float16"))
    message = command_refusal(mergekit_yaml, recipe, out)
    assert "is Inf as float16 (after the recipe's `dtype: float16` cast" in message
    assert "values above 65504 do not fit float16: merge with `dtype: bfloat16` or `float32`" in message
    assert not os.path.exists(os.path.join(out, "model.safetensors"))
