"""The pre-pass counts exactly what the merge kernel receives.

A spy on the plugin's own kernel records, for every group it merges, the overlap counts
an independent reference computes from the tensors it was given; the pre-pass's
per-tensor counts (``ram_statistics.json``) must equal them, tensor for tensor. The
recipes use slices with layer remapping, a per-tensor epsilon filter, a dtype cast,
``tokenizer_source: union`` over different vocabularies, and a LoRA input.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from mergekit_ram.integration import methods
from mergekit_ram.synthetic import build_base, sparse_agents, tiny_config, write_checkpoint
from tests import reference
from tests.conftest import load_statistics, merge_in_process


def save_tokenizer(path: str, tokens: list[str]) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel(vocab={tok: i for i, tok in enumerate(tokens)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>").save_pretrained(path)


@pytest.fixture(scope="module")
def vocab_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A bfloat16 base, agent a (same vocabulary) and agent b (four extra tokens)."""
    root = tmp_path_factory.mktemp("vocab")
    tokens = ["<unk>"] + [f"t{i}" for i in range(1, 64)]
    config = tiny_config("llama", hidden_size=32, intermediate_size=48, num_layers=2, vocab_size=64)
    base = build_base(str(root / "base"), config, dtype=torch.bfloat16, seed=11)
    save_tokenizer(str(root / "base"), tokens)
    agents = sparse_agents(base, {(0,): 0.1, (1,): 0.15, (0, 1): 0.1}, seed=12)
    write_checkpoint(str(root / "a"), agents.states[0], config_source=str(root / "base"))
    save_tokenizer(str(root / "a"), tokens)

    state_b = dict(agents.states[1])
    generator = torch.Generator().manual_seed(13)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        extra = (torch.randn(4, 32, generator=generator) * 0.02).to(torch.bfloat16)
        state_b[name] = torch.cat([state_b[name], extra])
    config_b = tiny_config("llama", hidden_size=32, intermediate_size=48, num_layers=2, vocab_size=68)
    config_b.dtype = torch.bfloat16
    write_checkpoint(str(root / "b"), state_b, config=config_b)
    save_tokenizer(str(root / "b"), tokens + ["x0", "x1", "x2", "x3"])
    return {"base": str(root / "base"), "a": str(root / "a"), "b": str(root / "b"), "root": str(root)}


def spy_on_kernel(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Record reference counts of every group the kernel merges (the merge step, not the pre-pass's counts)."""
    received: dict[str, Any] = {}
    original = methods.Kernels.merge

    def spy(self: methods.Kernels, method: str, group, epsilon: float, *args: Any, **kwargs: Any):
        finetunes = [entry.tensor for entry in group.non_base]
        counts = reference.counts(group.base.tensor, finetunes, epsilon)
        received[group.metadata.name] = {
            "models": [str(entry.id) for entry in group.non_base],
            "histograms": counts.histograms,
            "epsilon": epsilon,
            "dtype": group.base.tensor.dtype,
        }
        return original(self, method, group, epsilon, *args, **kwargs)

    monkeypatch.setattr(methods.Kernels, "merge", spy)
    return received


def assert_prepass_matches(out: str, received: dict[str, Any]) -> dict[str, Any]:
    statistics = load_statistics(out)
    assert statistics["source"] == "pre-pass"
    prepass = {entry["name"]: entry for entry in statistics["tensors"]}
    assert set(prepass) == set(received)
    for name, seen in received.items():
        assert prepass[name]["models"] == seen["models"], name
        assert prepass[name]["histograms"] == seen["histograms"], name
        assert prepass[name]["epsilon"] == seen["epsilon"], name
    return prepass


def test_slices_filters_dtype_and_tokenizer_union(vocab_models, monkeypatch, tmp_path) -> None:
    received = spy_on_kernel(monkeypatch)
    base, a, b = vocab_models["base"], vocab_models["a"], vocab_models["b"]
    recipe = {
        "merge_method": "ram_plus",
        "base_model": base,
        "slices": [
            {"sources": [{"model": m, "layer_range": [0, 1]} for m in (a, b, base)]},
            {
                "sources": [
                    {"model": a, "layer_range": [0, 1]},  # layer 0 of a again, as output layer 1
                    {"model": b, "layer_range": [1, 2]},
                    {"model": base, "layer_range": [1, 2]},
                ]
            },
        ],
        "parameters": {"epsilon": [{"filter": "mlp", "value": 0.01}, {"value": 1.0e-5}], "r": 0.1},
        "tokenizer_source": "union",
        "dtype": "float32",
    }
    out = str(tmp_path / "out")
    merge_in_process(recipe, out)
    prepass = assert_prepass_matches(out, received)

    assert prepass["model.layers.0.mlp.up_proj.weight"]["epsilon"] == 0.01
    assert prepass["model.layers.0.self_attn.q_proj.weight"]["epsilon"] == 1e-5
    assert all(seen["dtype"] == torch.float32 for seen in received.values())
    embed = received["model.embed_tokens.weight"]
    assert prepass["model.embed_tokens.weight"]["numel"] == 68 * 32  # the union vocabulary
    assert embed["histograms"][1] == [284, 186]  # b's changes (unique, shared), its four extra rows included
    # The layer remapping: output layer 1 merges a's layer 0 with b's layer 1.
    assert (
        received["model.layers.1.mlp.down_proj.weight"]["histograms"]
        != received["model.layers.0.mlp.down_proj.weight"]["histograms"]
    )


def test_lora_input(vocab_models, monkeypatch, tmp_path) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    adapter = str(tmp_path / "adapter")
    model = AutoModelForCausalLM.from_pretrained(vocab_models["a"], dtype=torch.float32)
    torch.manual_seed(0)  # peft draws lora_A from torch's generator: seeded, the counts below are constants
    peft_model = get_peft_model(model, LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn_like(parameter) * 0.05)
    peft_model.save_pretrained(adapter)

    received = spy_on_kernel(monkeypatch)
    recipe = {
        "merge_method": "ram_plus",
        "base_model": vocab_models["base"],
        "models": [{"model": f"{vocab_models['a']}+{adapter}"}, {"model": vocab_models["a"]}],
        "parameters": {"r": 0.1},
    }
    out = str(tmp_path / "out")
    merge_in_process(recipe, out, lora_merge_cache=str(tmp_path / "lora_cache"))
    prepass = assert_prepass_matches(out, received)
    q_proj = prepass["model.layers.0.self_attn.q_proj.weight"]["histograms"]
    mlp = prepass["model.layers.0.mlp.up_proj.weight"]["histograms"]
    # The adapter made unique changes in q_proj (and undid one of a's), none in the MLP, where both
    # inputs carry a's changes. Seeded: constants, measured once.
    assert q_proj == [[816, 206], [1, 206]]
    assert mlp == [[0, 306], [0, 306]]
    assert len(os.listdir(str(tmp_path / "lora_cache"))) == 1  # the adapter merged into a, once


def test_lambdas_reach_every_place_a_model_appears() -> None:
    """The lambdas are written into each model's own parameters wherever the recipe names it, matched as
    mergekit names the model (LoRA and revision included); a pinned model and the base are left as they are."""
    from mergekit.config import MergeConfiguration

    from mergekit_ram.integration.merge import with_lambdas
    from mergekit_ram.lambdas import Applied

    lora, revision, pinned = "/m/a+/m/adapter", "/m/b@v2", "/m/c"
    applied = {lora: Applied(1.2, 0.5), revision: Applied(1.1, float("inf"))}
    recipes = {
        "models": {
            "models": [{"model": m} for m in (lora, revision)] + [{"model": pinned, "parameters": {"lambda": 1.3}}]
        },
        "slices": {
            "slices": [{"sources": [{"model": m, "layer_range": [0, 2]} for m in (lora, revision, pinned, "/m/base")]}]
        },
        "modules": {
            "modules": {
                "text_decoder": {"models": [{"model": m} for m in (lora, revision, pinned)]},
                "vision_tower": {
                    "slices": [{"sources": [{"model": m, "layer_range": [0, 1]} for m in (lora, revision)]}]
                },
            }
        },
    }
    for kind, recipe in recipes.items():
        config = MergeConfiguration.model_validate({"merge_method": "ram_plus", "base_model": "/m/base", **recipe})
        injected = with_lambdas(config, applied, {model: model for model in applied})
        found = [(str(node.model), node.parameters) for node in _model_nodes(injected)]
        assert {model for model, _ in found} >= {lora, revision}, kind
        for model, parameters in found:
            if model == lora:
                assert parameters == {"lambda": 1.2, "rho": 0.5}, kind
            elif model == revision:
                assert parameters == {"lambda": 1.1}, kind  # an infinite rho is no parameter
            elif model == pinned:
                assert parameters in ({"lambda": 1.3}, None), kind
            else:
                assert not parameters, kind
        assert (
            config.model_dump()
            == MergeConfiguration.model_validate(
                {"merge_method": "ram_plus", "base_model": "/m/base", **recipe}
            ).model_dump()
        )  # the caller's recipe is not changed


def _model_nodes(node: Any) -> list[Any]:
    from pydantic import BaseModel

    if isinstance(node, BaseModel):
        fields = type(node).model_fields
        own = [node] if "model" in fields and "parameters" in fields else []
        return own + [found for name in fields for found in _model_nodes(getattr(node, name))]
    if isinstance(node, (list, tuple)):
        return [found for item in node for found in _model_nodes(item)]
    if isinstance(node, dict):
        return [found for item in node.values() for found in _model_nodes(item)]
    return []


def test_a_merge_without_run_merge_refuses_an_unpinned_ram_plus_lambda(vocab_models, tmp_path) -> None:
    """mergekit's planner run directly (as mergekit-evolve does): no global rho is counted there, so an
    unpinned ram_plus lambda is refused in one line naming the fix, never merged with another rho."""
    from mergekit.config import MergeConfiguration
    from mergekit.graph import Executor
    from mergekit.options import MergeOptions
    from mergekit.plan import MergePlanner

    from mergekit_ram.integration.merge import plan_merge
    from mergekit_ram.parameters import ParameterError

    recipe = {"merge_method": "ram_plus", "base_model": vocab_models["base"], "models": [{"model": vocab_models["a"]}]}
    config, options = MergeConfiguration.model_validate(recipe), MergeOptions(quiet=True)
    plan_merge(config, options)  # mergekit's loader cache warmed, as run_merge does
    from mergekit.architecture import get_architecture_info
    from mergekit.merge import _model_out_config

    arch_info = get_architecture_info(config, options)
    planner = MergePlanner(config, arch_info, options=options, out_model_config=_model_out_config(config, arch_info))
    targets = planner.plan_to_disk(out_path=str(tmp_path / "out"))
    with pytest.raises(
        ParameterError, match=r"^ram_plus: tensor .*: the lambda of .* needs the global rho.*set `r: 0`$"
    ):
        Executor(targets).execute()
