"""The in-memory API gives what the mergekit path gives, with global rho."""

from __future__ import annotations

import pytest
import torch

from mergekit_ram import merge_state_dicts
from tests import reference
from tests.conftest import ModelSet, load_statistics, load_weights, run_script, write_recipe


@pytest.mark.parametrize("method", ["ram", "ram_plus"])
def test_state_dicts_merge_like_mergekit_yaml(bf16_models: ModelSet, tmp_path, method: str) -> None:
    out = str(tmp_path / "out")
    run_script("mergekit-yaml", write_recipe(str(tmp_path / "r.yml"), bf16_models.recipe(method)), out)
    base = load_weights(bf16_models.base)
    finetunes = {path: load_weights(path) for path in bf16_models.agents}
    merged, statistics = merge_state_dicts(base, finetunes, method=method)
    expected = load_weights(out)
    assert set(merged) == set(expected)
    for name, tensor in expected.items():
        assert merged[name].dtype == torch.bfloat16
        assert torch.equal(merged[name], tensor), name
    from_disk = load_statistics(out)["models"]
    assert [s.lambda_ for s in statistics.models] == [m["lambda"] for m in from_disk]
    assert [s.shared for s in statistics.models] == [m["shared"] for m in from_disk]
    assert statistics.source == ("pre-pass" if method == "ram_plus" else "merge")


def test_soft_rule_and_out_dtype(bf16_models: ModelSet) -> None:
    base = load_weights(bf16_models.base)
    finetunes = [load_weights(path) for path in bf16_models.agents]
    merged, statistics = merge_state_dicts(base, finetunes, rule="soft", r=0.2, out_dtype=torch.float32)
    for model in statistics.models:
        assert model.lambda_ == reference.lambda_soft(reference.rho(model.shared, model.unique), 0.2)
    name = "model.layers.1.self_attn.o_proj.weight"
    lambdas = [model.lambda_ for model in statistics.models]
    # out_dtype casts the result, which keeps the checkpoint's dtype until then (as in mergekit).
    expected = reference.merge(base[name], [ft[name] for ft in finetunes], 1e-5, lambdas).to(torch.bfloat16).float()
    assert merged[name].dtype == torch.float32
    assert torch.equal(merged[name], expected)


def test_mismatched_inputs_name_model_and_tensor(bf16_models: ModelSet) -> None:
    base = load_weights(bf16_models.base)
    broken = dict(base)
    broken["model.norm.weight"] = torch.ones(7, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"agent: tensor model.norm.weight has shape \(7,\); the base's is \(32,\)"):
        merge_state_dicts(base, {"agent": broken})
    poisoned = dict(base)
    poisoned["lm_head.weight"] = base["lm_head.weight"].clone()
    poisoned["lm_head.weight"][0, 0] = float("nan")
    with pytest.raises(ValueError, match="agent: tensor lm_head.weight contains NaN or Inf"):
        merge_state_dicts(base, {"agent": poisoned, "other": base})
