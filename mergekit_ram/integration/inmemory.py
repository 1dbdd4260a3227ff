"""mergekit's ``merge_state_dicts`` for RAM methods, checked with the recipe's rules, plus the call's statistics.

merged, statistics = merge_state_dicts({"base": base, "coder": coder}, "ram_plus", base="base")
"""

from __future__ import annotations

import importlib
from typing import Any, Hashable, Mapping, Optional, Sequence, Union

import torch

from mergekit_ram.integration.internals import check_internals, internal
from mergekit_ram.integration.methods import RamMergeMethod
from mergekit_ram.integration.registry import register_methods
from mergekit_ram.parameters import METHOD_PARAMETERS, ParameterError, check_parameter
from mergekit_ram.stats.data import RamStatistics

mergekit_merge_state_dicts: Any = internal("mergekit.merge_methods", "merge_state_dicts")
ModelLike = Union[Mapping[str, torch.Tensor], torch.nn.Module]


def merge_state_dicts(
    models: Union[Mapping[Hashable, ModelLike], Sequence[ModelLike]],
    method: Any,
    /,
    *,
    parameters: Optional[Mapping[str, Any]] = None,
    base: Optional[Hashable] = None,
    strict: bool = True,
    dtype: Optional[torch.dtype] = None,
    out_dtype: Optional[torch.dtype] = None,
    batch_options: Any = None,
) -> tuple[dict[str, torch.Tensor], RamStatistics]:
    """``base`` is required; per-model pins (``{"lambda": {"coder": 1.2}}``) may name some models only."""
    method = getattr(getattr(method, "spec", None), "name", method)
    if method not in METHOD_PARAMETERS:
        raise ParameterError(f"method must be one of {', '.join(METHOD_PARAMETERS)}; got {method!r}")
    named: dict[Hashable, ModelLike] = dict(models) if isinstance(models, Mapping) else dict(enumerate(models))
    if base is None or base not in named:
        raise ParameterError(f"{method}: `base` must name the base model among {list(named)}; got {base!r}")
    finetunes = [key for key in named if key != base]
    _check_parameters(method, parameters or {}, finetunes)
    _check_inputs(named, base, strict)
    check_internals()
    register_methods(importlib.import_module("mergekit.merge_methods"))  # also where the start-up hook is off
    received: list[RamStatistics] = []
    merged = mergekit_merge_state_dicts(
        models,
        RamMergeMethod(method, statistics_sink=received.append),  # this call's own instance
        parameters=parameters,
        base=base,
        strict=strict,
        dtype=dtype,
        out_dtype=out_dtype,
        batch_options=batch_options,
    )
    (statistics,) = received
    return merged, statistics


def _check_parameters(method: str, parameters: Mapping[str, Any], finetunes: Sequence[Hashable]) -> None:
    for name, setting in parameters.items():
        per_group = getattr(setting, "values", None)  # mergekit's PerGroupValues: one value per group
        for value in per_group if isinstance(per_group, tuple) else [setting]:
            if isinstance(value, Mapping):
                unknown = [model for model in value if model not in finetunes]
                if unknown:
                    raise ParameterError(
                        f"{method}: {name} set for unknown model {unknown[0]!r}; "
                        f"models: {', '.join(map(str, finetunes))}"
                    )
                value = list(value.values())
            for scalar in value if isinstance(value, Sequence) and not isinstance(value, str) else [value]:
                check_parameter(method, name, scalar, "merge_state_dicts arguments")


def _check_inputs(models: Mapping[Hashable, ModelLike], base: Hashable, strict: bool) -> None:
    """The same tensor names (``strict``) and shapes everywhere; identical non-floating buffers."""
    states = {
        key: model.state_dict(keep_vars=True) if isinstance(model, torch.nn.Module) else model
        for key, model in models.items()
    }
    reference = states[base]
    shared = set.intersection(*(set(state) for state in states.values()))
    for model, state in states.items():
        missing = sorted(set(reference) - set(state))
        extra = sorted(set(state) - set(reference))
        if strict and (missing or extra):
            raise ValueError(f"{model}: tensors differ from the base's (missing {missing[:5]}, extra {extra[:5]})")
        for name, tensor in reference.items():
            if name not in shared:
                continue
            other = state[name]
            if other.shape != tensor.shape:
                raise ValueError(
                    f"{model}: tensor {name} has shape {tuple(other.shape)}; the base's is {tuple(tensor.shape)}"
                )
            if tensor.is_floating_point() != other.is_floating_point():
                raise ValueError(f"{model}: tensor {name} is {other.dtype}; the base's is {tensor.dtype}")
            if not tensor.is_floating_point() and (other.dtype != tensor.dtype or not torch.equal(other, tensor)):
                raise ValueError(f"{model}: non-floating tensor {name} differs from the base's; RAM cannot merge it")
