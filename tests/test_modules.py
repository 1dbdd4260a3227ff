"""mergekit's ``modules:`` syntax: a tiny Qwen2-VL-style model (text decoder, vision tower, projector),
built locally, merged module by module.

rho is global: counted over every tensor of every module merged. The statistics also say what each
module holds for each model. Checked against the reference (tests/reference.py) on agents that
change each module with a known density.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch
from mergekit.config import MergeConfiguration
from mergekit.options import MergeOptions
from safetensors.torch import save_file

from mergekit_ram.probe import probe_config
from mergekit_ram.stats.render import module_table
from tests import reference
from tests.conftest import load_statistics, load_weights, merge_in_process
from tests.test_merge_exact import EPSILON, assert_same_weights

MODULES = ("text_decoder", "vision_tower", "multi_modal_projector")


def _shapes() -> dict[str, tuple[int, ...]]:
    """Every weight of mergekit 0.1.5's qwen2_vl architecture, at tiny sizes (hidden 32, vision 16)."""
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (64, 32),
        "model.norm.weight": (32,),
        "lm_head.weight": (64, 32),
        "visual.patch_embed.proj.weight": (16, 3, 2, 2, 2),
        "visual.merger.ln_q.weight": (16,),
        "visual.merger.ln_q.bias": (16,),
        "visual.merger.mlp.0.weight": (64, 64),
        "visual.merger.mlp.0.bias": (64,),
        "visual.merger.mlp.2.weight": (32, 64),
        "visual.merger.mlp.2.bias": (32,),
    }
    for layer in range(2):
        text = {"input_layernorm.weight": (32,), "post_attention_layernorm.weight": (32,)}
        text |= {"mlp.down_proj.weight": (32, 48), "mlp.gate_proj.weight": (48, 32), "mlp.up_proj.weight": (48, 32)}
        for projection, rows in (("q", 32), ("k", 16), ("v", 16)):
            text |= {f"self_attn.{projection}_proj.weight": (rows, 32), f"self_attn.{projection}_proj.bias": (rows,)}
        text["self_attn.o_proj.weight"] = (32, 32)
        vision = {f"norm{i}.{kind}": (16,) for i in (1, 2) for kind in ("weight", "bias")}
        vision |= {"attn.qkv.weight": (48, 16), "attn.qkv.bias": (48,), "attn.proj.weight": (16, 16)}
        vision |= {"attn.proj.bias": (16,), "mlp.fc1.weight": (32, 16), "mlp.fc1.bias": (32,)}
        vision |= {"mlp.fc2.weight": (16, 32), "mlp.fc2.bias": (16,)}
        shapes |= {f"model.layers.{layer}.{name}": shape for name, shape in text.items()}
        shapes |= {f"visual.blocks.{layer}.{name}": shape for name, shape in vision.items()}
    return shapes


def _module(name: str) -> str:
    return (
        "multi_modal_projector"
        if ".merger." in name
        else "vision_tower"
        if name.startswith("visual")
        else "text_decoder"
    )


def _save(path: str, state: dict[str, torch.Tensor]) -> None:
    from transformers import Qwen2VLConfig

    text = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, vocab_size=64)
    vision = dict(depth=2, embed_dim=16, hidden_size=32, num_heads=2, mlp_ratio=2, spatial_merge_size=2)
    tokens = dict(image_token_id=3, video_token_id=4, vision_start_token_id=5, vision_end_token_id=6)
    config = Qwen2VLConfig(
        text_config={**text, "num_key_value_heads": 2, "bos_token_id": 1, "eos_token_id": 2},
        vision_config={**vision, "in_channels": 3, "patch_size": 2, "temporal_patch_size": 2},
        vocab_size=64,
        **tokens,
    )
    config.architectures = ["Qwen2VLForConditionalGeneration"]
    os.makedirs(path)
    config.save_pretrained(path)
    with open(os.path.join(path, "config.json"), encoding="utf-8") as handle:
        data = json.load(handle)
    data["num_hidden_layers"] = 2  # where mergekit 0.1.5 reads it (Hub checkpoints of Qwen2-VL have it there)
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as handle:
        json.dump(data, handle)
    save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})


#: Per agent, the share of each module it changes: agent 0 trained mostly the vision side, agent 1 the text.
DENSITIES = ({"text_decoder": 0.05, "vision_tower": 0.3, "multi_modal_projector": 0.3},
             {"text_decoder": 0.3, "vision_tower": 0.05, "multi_modal_projector": 0.05})  # fmt: skip


@pytest.fixture(scope="module")
def vl_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("vl")
    generator = torch.Generator().manual_seed(0)
    base = {name: torch.randn(shape, generator=generator).to(torch.bfloat16) for name, shape in _shapes().items()}
    _save(str(root / "base"), base)
    agents = []
    for index, densities in enumerate(DENSITIES):
        state = {}
        for name, tensor in base.items():
            changed = torch.rand(tensor.shape, generator=generator) < densities[_module(name)]
            state[name] = torch.where(changed, tensor + 0.125, tensor)
        _save(str(root / f"agent{index}"), state)
        agents.append(str(root / f"agent{index}"))
    return {"base": str(root / "base"), "agents": agents}


def modules_recipe(vl: dict[str, Any], method: str, **parameters: Any) -> dict[str, Any]:
    models = [{"model": path} for path in vl["agents"]]
    recipe: dict[str, Any] = {"merge_method": method, "base_model": vl["base"]}
    recipe["modules"] = {module: {"models": models} for module in MODULES}
    if parameters:
        recipe["parameters"] = parameters
    return recipe


def reference_counts(vl: dict[str, Any]) -> dict[str, list[tuple[int, int]]]:
    """(shared, unique) per agent, over every tensor ("all") and per module."""
    base, finetunes = load_weights(vl["base"]), [load_weights(path) for path in vl["agents"]]
    totals: dict[str, list[tuple[int, int]]] = {}
    for name, tensor in base.items():
        counts = reference.counts(tensor, [ft[name] for ft in finetunes], EPSILON)
        for key in ("all", _module(name)):
            before = totals.setdefault(key, [(0, 0)] * len(finetunes))
            totals[key] = [(s + cs, u + cu) for (s, u), cs, cu in zip(before, counts.shared, counts.unique)]
    return totals


def test_ram_plus_counts_rho_over_every_module(vl_models: dict[str, Any], tmp_path) -> None:
    out = str(tmp_path / "out")
    merge_in_process(modules_recipe(vl_models, "ram_plus"), out)
    counts = reference_counts(vl_models)
    lambdas = [reference.lambda_clip(reference.rho(shared, unique), 0.1, 2.0) for shared, unique in counts["all"]]
    base, finetunes = load_weights(vl_models["base"]), [load_weights(path) for path in vl_models["agents"]]
    expected = {
        name: reference.merge(tensor, [ft[name] for ft in finetunes], EPSILON, lambdas).to(tensor.dtype)
        for name, tensor in base.items()
    }
    assert_same_weights(load_weights(out), expected)
    statistics = load_statistics(out)
    # Each tensor counted once: mergekit 0.1.5 plans the projector's four twice (62 merge tasks).
    assert len(statistics["tensors"]) == len(base) == 58
    assert [(m["shared"], m["unique"]) for m in statistics["models"]] == counts["all"]
    assert [m["lambda"] for m in statistics["models"]] == lambdas
    assert list(statistics["modules"]) == list(MODULES)  # the recipe's order
    for module in MODULES:
        assert [(m["shared"], m["unique"]) for m in statistics["modules"][module]] == counts[module]
    # Agent 0 changed the vision side: its rho there is low (mostly unique), high in the text decoder.
    local = {module: statistics["modules"][module][0]["local_rho"] for module in MODULES}
    assert local["vision_tower"] < 0.1 < local["text_decoder"]
    with open(os.path.join(out, "README.md"), encoding="utf-8") as handle:
        card = handle.read()
    assert "Per module (rho local to the module; lambda uses the rho over every module):" in card
    assert card.count("| vision_tower |") == 2


@pytest.mark.parametrize("method", ["ram_ties", "ram_unique"])
def test_the_variants_merge_every_module(vl_models: dict[str, Any], method: str, tmp_path) -> None:
    out = str(tmp_path / "out")
    merge_in_process(modules_recipe(vl_models, method), out)
    base, finetunes = load_weights(vl_models["base"]), [load_weights(path) for path in vl_models["agents"]]
    rule = {
        "ram_ties": lambda base_t, fts: reference.ties_merge(base_t, fts, EPSILON, 0.1),
        "ram_unique": lambda base_t, fts: reference.unique_merge(base_t, fts, EPSILON, [1.0, 1.0]),
    }[method]
    expected = {name: rule(tensor, [ft[name] for ft in finetunes]).to(tensor.dtype) for name, tensor in base.items()}
    assert_same_weights(load_weights(out), expected)
    assert list(load_statistics(out)["modules"]) == list(MODULES)


def test_the_probe_splits_by_module(vl_models: dict[str, Any]) -> None:
    statistics = probe_config(MergeConfiguration.model_validate(modules_recipe(vl_models, "ram_plus")), MergeOptions())
    table = module_table(statistics)
    assert "vision_tower: attention" in table and "text_decoder: mlp" in table
    assert [(m.shared, m.unique) for m in statistics.models] == reference_counts(vl_models)["all"]
