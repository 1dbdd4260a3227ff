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
- ``region_controls``: the control Figure 3 lacks. Each agent's unique region (the elements
  only it changed) added alone at scale 1, against random subsets of its changed elements of
  the same size, and against its shared region: whether unique elements carry more of the skill
  per element than any of its changes do.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from benchmarks.agents.evaluate import EvalSets, accuracy
from benchmarks.agents.model import load_model

DOSES = (0.1, 0.2, 1 / 3, 0.5, 1.0)
#: Random subsets drawn per agent in ``region_controls`` (their spread is the control's noise).
CONTROL_DRAWS = 3
#: RAM's default epsilon: a change is an element with abs(tau) above it.
EPSILON = 1e-5
#: Binades reported; smaller weights (and zeros) are pooled in the first, larger ones in the last.
BINADES = tuple(range(-9, 1))


def _states(paths: Mapping[str, str]) -> dict[str, dict[str, torch.Tensor]]:
    return {
        name: {k: v.detach().clone() for k, v in load_model(path).state_dict().items()} for name, path in paths.items()
    }


def _changed(
    base_state: Mapping[str, torch.Tensor], states: Mapping[str, Mapping[str, torch.Tensor]], epsilon: float
) -> tuple[list[str], dict[str, torch.Tensor]]:
    """The floating-point tensors' names, and each agent's flat mask of changed elements over them (that order)."""
    names = [name for name in base_state if base_state[name].is_floating_point()]
    masks = {
        task: torch.cat([((state[name] - base_state[name]).abs() > epsilon).flatten() for name in names])
        for task, state in states.items()
    }
    return names, masks


def where_updates_land(base: str, agents: Mapping[str, str], epsilon: float = EPSILON) -> dict[str, Any]:
    """Density per binade of |w_base| for each agent (None: no weight there), and overlap against independence.

    ``binades``: each binade's exponent, share of all weights and half a bfloat16 step there;
    ``agents``: each agent's density, by binade too, unique share, and unique share if independent.
    """
    states = _states({"base": base, **agents})
    base_state = states.pop("base")
    names, masks = _changed(base_state, states, epsilon)
    weights = torch.cat([base_state[name].flatten().abs() for name in names])
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


def _with_region(
    base_state: Mapping[str, torch.Tensor],
    agent_state: Mapping[str, torch.Tensor],
    names: Sequence[str],
    region: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """The base with the agent's values on ``region`` (a flat mask over ``names``): base + tau there, scale 1."""
    state = dict(base_state)
    offset = 0
    for name in names:
        size = base_state[name].numel()
        mask = region[offset : offset + size].view_as(base_state[name])
        state[name] = torch.where(mask, agent_state[name], base_state[name])
        offset += size
    return state


def _loaded(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> torch.nn.Module:
    model.load_state_dict(state, strict=True)
    return model


def random_subset(mask: torch.Tensor, size: int, seed: int) -> torch.Tensor:
    """``size`` elements of ``mask`` drawn uniformly without replacement, as a mask of the same shape."""
    chosen = mask.nonzero().flatten()
    chosen = chosen[torch.randperm(chosen.numel(), generator=torch.Generator().manual_seed(seed))[:size]]
    subset = torch.zeros_like(mask)
    subset[chosen] = True
    return subset


def region_controls(
    base: str, agents: Mapping[str, str], sets: EvalSets, batch_size: int, epsilon: float = EPSILON
) -> dict[str, dict[str, Any]]:
    """Per agent: own-task test accuracy of one region of its update added alone at scale 1, and its size.

    ``unique``: the elements only this agent changed; ``shared``: those another agent changed too;
    ``random``: CONTROL_DRAWS random subsets of all its changed elements, each as large as ``unique``.
    """
    states = _states({"base": base, **agents})
    base_state = states.pop("base")
    names, masks = _changed(base_state, states, epsilon)
    count = torch.stack(list(masks.values())).sum(0)
    model = load_model(base)
    result: dict[str, dict[str, Any]] = {}
    for index, (task, mask) in enumerate(masks.items()):
        unique, shared = mask & (count == 1), mask & (count > 1)
        size = int(unique.sum())

        draws = [random_subset(mask, size, 1000 * index + draw) for draw in range(CONTROL_DRAWS)]
        scores = [
            accuracy(
                _loaded(model, _with_region(base_state, states[task], names, region)), sets["test"][task], batch_size
            )
            for region in (unique, shared, *draws)
        ]
        result[task] = {
            "changed": int(mask.sum()),
            "parameters": mask.numel(),
            "unique": {"elements": size, "accuracy": scores[0]},
            "shared": {"elements": int(shared.sum()), "accuracy": scores[1]},
            "random": {"elements": size, "accuracies": scores[2:]},
        }
    return result
