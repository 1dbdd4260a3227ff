"""Why the merges behave as they do: where the agents' updates land, and how much of them is needed.

Two measurements on the checkpoints themselves (no merging):

- ``where_updates_land``: the share of elements each agent changed (|tau| > epsilon), by
  binade of the base weight (|w| in [2^k, 2^(k+1)), where one bfloat16 step is 2^(k-7)),
  and the unique share expected if the agents' changes were independent,
  prod_{s != t} (1 - density_s). A bfloat16 checkpoint only records a change larger than
  half a step of the weight, so every agent's changes fall on the same small weights and
  overlap more than chance would have them.
- ``dose_response``: the own-task test accuracy of theta_base + lambda * tau_t, one agent at
  a time. If a small lambda already gives the whole gain, averaging (which scales an
  agent's update down) costs little, and RAM's protection of unique updates has nothing to
  recover.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from benchmarks.agents.evaluate import EvalSets, accuracy
from benchmarks.agents.model import load_model

DOSES = (0.1, 0.2, 1 / 3, 0.5, 1.0)
#: Binades reported; smaller weights (and zeros) are pooled in the first, larger ones in the last.
BINADES = tuple(range(-9, 1))


def _states(paths: Mapping[str, str]) -> dict[str, dict[str, torch.Tensor]]:
    return {
        name: {k: v.detach().clone() for k, v in load_model(path).state_dict().items()} for name, path in paths.items()
    }


def where_updates_land(base: str, agents: Mapping[str, str], epsilon: float = 1e-5) -> dict[str, Any]:
    """Density per binade of |w_base| for each agent (None: no weight there), and overlap against independence.

    ``binades``: each binade's exponent, share of all weights and half a bfloat16 step there;
    ``agents``: each agent's density, by binade too, unique share, and unique share if independent.
    """
    states = _states({"base": base, **agents})
    base_state = states.pop("base")
    names = [name for name in base_state if base_state[name].is_floating_point()]
    weights = torch.cat([base_state[name].flatten().abs() for name in names])
    masks = {
        task: torch.cat([((state[name] - base_state[name]).abs() > epsilon).flatten() for name in names])
        for task, state in states.items()
    }
    exponent = torch.floor(torch.log2(weights.clamp(min=2.0**-126))).long().clamp(min=BINADES[0], max=BINADES[-1])
    count = torch.stack(list(masks.values())).sum(0)
    densities = {task: mask.float().mean().item() for task, mask in masks.items()}
    binades = [
        {"exponent": k, "share_of_weights": (exponent == k).float().mean().item(), "half_step": 2.0 ** (k - 8)}
        for k in BINADES
    ]
    updates = {}
    for task, mask in masks.items():
        independent = 1.0
        for other, density in densities.items():
            if other != task:
                independent *= 1.0 - density
        updates[task] = {
            "density": densities[task],
            "density_by_binade": [
                mask[exponent == k].float().mean().item() if (exponent == k).any() else None for k in BINADES
            ],
            "unique_share": (mask & (count == 1)).sum().item() / max(int(mask.sum()), 1),
            "unique_share_if_independent": independent,
        }
    return {"binades": binades, "agents": updates}


def dose_response(
    base: str, agents: Mapping[str, str], sets: EvalSets, batch_size: int, doses: Sequence[float] = DOSES
) -> dict[str, dict[str, float]]:
    """``{task: {lambda: own-task test accuracy of theta_base + lambda * tau_task}}``."""
    model = load_model(base)
    base_state = {k: v.clone() for k, v in model.state_dict().items()}
    result: dict[str, dict[str, float]] = {}
    for task, path in agents.items():
        agent_state = load_model(path).state_dict()
        result[task] = {}
        for dose in doses:
            model.load_state_dict(
                {k: base_state[k] + dose * (agent_state[k] - base_state[k]) for k in base_state}, strict=True
            )
            result[task][f"{dose:.3g}"] = accuracy(model, sets["test"][task], batch_size)
    return result
