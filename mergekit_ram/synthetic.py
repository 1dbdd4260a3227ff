"""Tiny base models and sparse synthetic "agents", built locally for the demo, tests and benchmarks: each
element draws which agents change it from a joint distribution over subsets, so densities and overlaps
are set by construction, and the masks drawn are returned for checking.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import shutil
from typing import Mapping, NamedTuple, Optional, Sequence

import torch
from safetensors.torch import save_file

Subset = tuple[int, ...]

#: The paper's three Qwen2.5-7B agents (section 3, Figure 2): densities 3.2%, 46.2%, 54.3%, unique shares
#: 6.3%, 40.8%, 47.5%; the empty subset takes the rest.
PAPER_OVERLAP: dict[Subset, float] = {
    (0,): 0.002,
    (1,): 0.1885,
    (2,): 0.258,
    (0, 2): 0.010,
    (1, 2): 0.2535,
    (0, 1, 2): 0.020,
}
PAPER_AGENTS = ("coding-agent", "tool-agent", "memory-agent")


def independent_overlap(densities: Sequence[float]) -> dict[Subset, float]:
    """The joint distribution when each agent changes each element independently."""
    agents = range(len(densities))
    return {
        subset: math.prod(density if index in subset else 1.0 - density for index, density in enumerate(densities))
        for size in range(1, len(densities) + 1)
        for subset in itertools.combinations(agents, size)
    }


def tiny_config(
    architecture: str = "qwen2",
    *,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    vocab_size: int = 256,
    tie_word_embeddings: bool = False,
):
    """A small Llama or Qwen2 configuration: transformers' own config class for ``architecture``."""
    from transformers import AutoConfig

    return AutoConfig.for_model(
        architecture,
        architectures=[f"{architecture.capitalize()}ForCausalLM"],
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        vocab_size=vocab_size,
        max_position_embeddings=256,
        tie_word_embeddings=tie_word_embeddings,
    )


def build_base(path: str, config, *, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> dict[str, torch.Tensor]:
    """Initialise a model from ``config`` with a fixed seed and save it as safetensors."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    config.dtype = dtype
    state = {name: tensor.detach().to(dtype).contiguous() for name, tensor in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    write_checkpoint(path, state, config=config)
    return state


def write_checkpoint(
    path: str, state: Mapping[str, torch.Tensor], *, config_source: Optional[str] = None, config=None
) -> None:
    """Save ``state`` as ``model.safetensors`` with a config (copied, or from ``config``)."""
    os.makedirs(path, exist_ok=True)
    save_file(dict(state), os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    if config is not None:
        config.save_pretrained(path)
    elif config_source is not None:
        shutil.copy(os.path.join(config_source, "config.json"), os.path.join(path, "config.json"))


class Agents(NamedTuple):
    """Fine-tuned state dicts and, per tensor, which elements each agent changed."""

    states: list[dict[str, torch.Tensor]]
    masks: dict[str, torch.Tensor]  # tensor name -> bool [n_agents, *shape]


def sparse_agents(
    base: Mapping[str, torch.Tensor],
    overlap: Mapping[Subset, float],
    *,
    seed: int = 0,
    relative_change: tuple[float, float] = (0.02, 0.1),
    minimum_change: float = 1e-3,
) -> Agents:
    """Fine-tunes of ``base`` whose changed elements follow ``overlap``; a change is large enough to survive
    rounding and the default epsilon, unchanged elements are bit-identical to the base."""
    n_agents = 1 + max(max(subset) for subset in overlap)
    total = sum(overlap.values())
    if total > 1.0 + 1e-9:
        raise ValueError("overlap probabilities sum to more than 1")
    probabilities = torch.tensor([max(0.0, 1.0 - total), *overlap.values()], dtype=torch.float64)
    membership = torch.tensor([[index in subset for index in range(n_agents)] for subset in [(), *overlap]])
    thresholds = probabilities.cumsum(0)[:-1]
    low, high = relative_change
    generator = torch.Generator().manual_seed(seed)
    states: list[dict[str, torch.Tensor]] = [{} for _ in range(n_agents)]
    masks = {}
    for name, tensor in base.items():
        if not tensor.is_floating_point():
            for state in states:
                state[name] = tensor.clone()
            continue
        draws = torch.rand(tensor.shape, generator=generator, dtype=torch.float64)
        category = torch.bucketize(draws, thresholds, right=True)
        mask = membership[category].movedim(-1, 0)  # [n_agents, *shape]
        weight = tensor.float()
        for index in range(n_agents):
            scale = low + (high - low) * torch.rand(tensor.shape, generator=generator)
            sign = torch.where(torch.rand(tensor.shape, generator=generator) < 0.5, -1.0, 1.0)
            delta = sign * (weight.abs() * scale + minimum_change)
            changed = torch.where(mask[index], weight + delta, weight).to(tensor.dtype)
            states[index][name] = torch.where(mask[index], changed, tensor)
        masks[name] = mask
    return Agents(states, masks)


def build_agents(
    directory: str,
    config,
    overlap: Mapping[Subset, float],
    names: Sequence[str],
    *,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
) -> tuple[str, list[str], Agents]:
    """Write ``directory/base`` and one checkpoint per agent; return their paths."""
    base_path = os.path.join(directory, "base")
    base = build_base(base_path, config, dtype=dtype, seed=seed)
    agents = sparse_agents(base, overlap, seed=seed + 1)
    paths = []
    for name, state in zip(names, agents.states):
        path = os.path.join(directory, name)
        write_checkpoint(path, state, config_source=base_path)
        paths.append(path)
    with open(os.path.join(directory, "overlap.json"), "w", encoding="utf-8") as handle:
        json.dump(
            {"agents": list(names), "overlap": {",".join(map(str, s)): p for s, p in overlap.items()}}, handle, indent=2
        )
    return base_path, paths, agents
