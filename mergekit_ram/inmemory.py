"""RAM / RAM+ on in-memory state dicts, with the paper's global rho; no mergekit needed.

    from mergekit_ram import merge_state_dicts
    merged, statistics = merge_state_dicts(base.state_dict(), {"coder": coder.state_dict(), ...})

Two passes over the tensors for ``ram_plus`` (counts, then merge), one otherwise.
"""

from __future__ import annotations

from typing import Literal, Mapping, Optional, Sequence, Union

import torch

from mergekit_ram.kernel import NonFiniteInputError, ram_merge
from mergekit_ram.parameters import ParameterError, check_parameter
from mergekit_ram.stats import Pin, RamStatistics, TensorCounts

StateDict = Mapping[str, torch.Tensor]

_WHERE = "merge_state_dicts arguments"


def merge_state_dicts(
    base: StateDict,
    finetunes: Union[Mapping[str, StateDict], Sequence[StateDict]],
    *,
    method: Literal["ram", "ram_plus"] = "ram_plus",
    epsilon: float = 1e-5,
    r: float = 0.1,
    alpha: float = 2.0,
    rule: Literal["clip", "soft"] = "clip",
    rho: Optional[Mapping[str, float]] = None,
    lambda_: Optional[Mapping[str, float]] = None,
    out_dtype: Optional[torch.dtype] = None,
) -> tuple[dict[str, torch.Tensor], RamStatistics]:
    """Merge fine-tuned state dicts into ``base`` with RAM (``method="ram"``) or RAM+.

    ``finetunes`` maps a name to each state dict (a sequence is named ``model_0``, ...).
    ``rho`` / ``lambda_`` pin those values per model name; unpinned models get the rho
    counted over every tensor. Returns the merged state dict (each tensor in its base
    dtype, or ``out_dtype``) and the statistics. Non-floating tensors must be identical.
    """
    if method not in ("ram", "ram_plus"):
        raise ParameterError(f"method must be 'ram' or 'ram_plus'; got {method!r}")
    named = dict(finetunes) if isinstance(finetunes, Mapping) else {f"model_{i}": sd for i, sd in enumerate(finetunes)}
    epsilon = check_parameter(method, "epsilon", epsilon, _WHERE)
    if method == "ram":
        r, pins = 0.0, {}
    else:
        r = check_parameter(method, "r", r, _WHERE)
        alpha = check_parameter(method, "alpha", alpha, _WHERE)
        rule = check_parameter(method, "rule", rule, _WHERE)
        pins = _pins(named, rho, lambda_)
    _check_inputs(base, named)

    models = list(named)
    floating = [name for name, tensor in base.items() if tensor.is_floating_point()]
    needs_prepass = r > 0 and any(model not in pins for model in models)
    if needs_prepass:
        counted = [_merge_one(name, base, named, epsilon, None, merge=False)[1] for name in floating]
        lambdas = RamStatistics.build(method, counted, r=r, alpha=alpha, rule=rule, pins=pins).lambdas()
    else:
        lambdas = RamStatistics.build(method, [], r=r, alpha=alpha, rule=rule, pins=pins).lambdas()
    lambda_values = [lambdas.get(model, 1.0) for model in models]

    merged: dict[str, torch.Tensor] = {}
    tensors: list[TensorCounts] = []
    for name, tensor in base.items():
        if not tensor.is_floating_point():
            merged[name] = tensor.clone()
            continue
        result, counts = _merge_one(name, base, named, epsilon, lambda_values, merge=True)
        merged[name] = result if out_dtype is None else result.to(out_dtype)
        tensors.append(counts)
    statistics = RamStatistics.build(
        method,
        tensors,
        r=r,
        alpha=alpha,
        rule=rule,
        pins=pins,
        source="pre-pass" if needs_prepass else "merge",
    )
    return merged, statistics


def _merge_one(
    name: str,
    base: StateDict,
    named: Mapping[str, StateDict],
    epsilon: float,
    lambdas: Optional[list[float]],
    *,
    merge: bool,
) -> tuple[Optional[torch.Tensor], TensorCounts]:
    try:
        result = ram_merge(base[name], [sd[name] for sd in named.values()], epsilon, lambdas, merge=merge, count=True)
    except NonFiniteInputError as error:
        model = "base" if error.index is None else list(named)[error.index]
        raise ValueError(f"{model}: tensor {name} contains NaN or Inf") from None
    counts = TensorCounts(
        name=name,
        numel=base[name].numel(),
        epsilon=epsilon,
        models=tuple(named),
        histograms=result.histograms or (),
    )
    return result.merged, counts


def _pins(
    named: Mapping[str, StateDict], rho: Optional[Mapping[str, float]], lambda_: Optional[Mapping[str, float]]
) -> dict[str, tuple[Pin, float]]:
    pins: dict[str, tuple[Pin, float]] = {}
    for kind, values in (("rho", rho or {}), ("lambda", lambda_ or {})):
        for model, value in values.items():
            if model not in named:
                raise ParameterError(f"ram_plus: {kind} pinned for unknown model {model!r}; models: {', '.join(named)}")
            pins[model] = (kind, check_parameter("ram_plus", kind, value, f"the pins of {model}"))  # type: ignore[assignment]
    return pins


def _check_inputs(base: StateDict, named: Mapping[str, StateDict]) -> None:
    """Same tensor names and shapes everywhere; identical non-floating buffers."""
    for model, state in named.items():
        missing = sorted(set(base) - set(state))
        extra = sorted(set(state) - set(base))
        if missing or extra:
            raise ValueError(f"{model}: tensors differ from the base's (missing {missing[:5]}, extra {extra[:5]})")
        for name, tensor in base.items():
            other = state[name]
            if other.shape != tensor.shape:
                raise ValueError(
                    f"{model}: tensor {name} has shape {tuple(other.shape)}; the base's is {tuple(tensor.shape)}"
                )
            if not tensor.is_floating_point() and (other.dtype != tensor.dtype or not torch.equal(other, tensor)):
                raise ValueError(f"{model}: non-floating tensor {name} differs from the base's; RAM cannot merge it")
            if tensor.is_floating_point() != other.is_floating_point():
                raise ValueError(f"{model}: tensor {name} is {other.dtype}; the base's is {tensor.dtype}")
