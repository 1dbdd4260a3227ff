"""``mergekit_ram.merge_state_dicts``: mergekit's ``merge_state_dicts`` for the four methods, checked with the
recipe's rules, counted over the whole call first where a lambda needs the global rho, with its statistics.

merged, statistics = merge_state_dicts({"base": base, "coder": coder}, "ram_plus", base="base")
"""

from __future__ import annotations

from typing import Any, Hashable, Mapping, Optional, Sequence, Union

import torch
from mergekit.merge_methods import merge_state_dicts as mergekit_merge_state_dicts

from mergekit_ram.integration import register
from mergekit_ram.integration.merge import count_tensors
from mergekit_ram.integration.methods import Kernels, Session, declared
from mergekit_ram.integration.recipes import check_parameter, per_model, whole_merge_defaults
from mergekit_ram.integration.recipes import declared as declared_parameters
from mergekit_ram.lambdas import Resolved, merge_rule
from mergekit_ram.parameters import METHOD_NAMES, ParameterError
from mergekit_ram.stats.data import RamStatistics

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
    if method not in METHOD_NAMES:
        raise ParameterError(f"method must be one of {', '.join(METHOD_NAMES)}; got {method!r}")
    named = _named_models(method, models)
    if not isinstance(base, Hashable) or base is None or base not in named:
        shown = repr(base) if isinstance(base, (str, int, type(None))) else type(base).__name__
        raise ParameterError(f"{method}: `base` must name the base model among {list(named)}; got {shown}")
    register()  # also where the start-up hook is off
    finetunes = [key for key in named if key != base]
    supplied = _filled(method, dict(parameters or {}), finetunes)
    _check_parameters(method, supplied, finetunes)
    states = _check_inputs(named, base, strict)
    merged_names = [name for name, tensor in states[base].items() if tensor.is_floating_point()]
    merged_names = [name for name in merged_names if all(name in state for state in states.values())]
    resolved = [
        _resolved(method, name, index, len(merged_names), supplied, finetunes)
        for index, name in enumerate(merged_names)
    ]
    rule = merge_rule(method, resolved, whole_merge_defaults(method))
    needs_counts = rule.needs_counts(map(str, finetunes))
    # Counted first, in memory: the inputs as given name a cast's harm (``non_finite_error``), and the lambdas
    # that need the global rho are then pinned for mergekit's own call.
    counts = [
        count_tensors(
            name,
            (base, states[base][name]),
            [(model, states[model][name]) for model in finetunes],
            tensor.shared["epsilon"],
            dtype,
        )
        for name, tensor in zip(merged_names, resolved)
    ]
    statistics = rule.statistics(counts, "pre-pass" if needs_counts else "merge")
    if needs_counts:
        applied = rule.applied([str(model) for model in finetunes], statistics)
        supplied["lambda"] = {model: applied[str(model)].lambda_ for model in finetunes}
    merged = mergekit_merge_state_dicts(
        models,
        declared(Kernels(Session(out_dtype=out_dtype)))[method],  # this call's own methods, its output dtype
        parameters=supplied,
        base=base,
        strict=strict,
        dtype=dtype,
        out_dtype=out_dtype,
        batch_options=batch_options,
    )
    return merged, statistics


def _named_models(method: str, models: Any) -> dict[Hashable, ModelLike]:
    """The models by name (a list's by position), each a state dict or a module; else one line saying what is
    expected."""
    if isinstance(models, Mapping):
        named = dict(models)
    elif isinstance(models, (list, tuple)):
        named = dict(enumerate(models))
    else:
        raise ParameterError(
            f"{method}: `models` must be a mapping of names to state dicts (or torch.nn.Module), or a list of them; "
            f"got {type(models).__name__}"
        )
    for key, model in named.items():
        if not isinstance(model, torch.nn.Module) and not (
            isinstance(model, Mapping) and all(isinstance(tensor, torch.Tensor) for tensor in model.values())
        ):
            raise ParameterError(
                f"{method}: model {key!r} must be a state dict (a mapping of tensor names to tensors) or a "
                f"torch.nn.Module; got {type(model).__name__}"
            )
    return named


def _filled(method: str, parameters: dict[str, Any], finetunes: Sequence[Hashable]) -> dict[str, Any]:
    """A per-model mapping naming some models only: the others get the default (mergekit would refuse it)."""
    for name, spec in declared_parameters(method).items():
        value = parameters.get(name)
        if per_model(spec) and isinstance(value, Mapping):
            parameters[name] = {**dict.fromkeys(finetunes, spec.default), **value}
    return parameters


def _resolved(
    method: str, name: str, index: int, count: int, parameters: Mapping[str, Any], finetunes: Sequence[Hashable]
) -> Resolved:
    """One tensor's values of the declared parameters (a ``PerGroupValues`` its value for this tensor)."""
    shared: dict[str, Any] = {}
    own: dict[str, dict[str, Any]] = {str(model): {} for model in finetunes}
    for parameter, spec in declared_parameters(method).items():
        value = parameters.get(parameter, spec.default)
        per_group = getattr(value, "values", None)  # mergekit's PerGroupValues: it refuses a wrong count
        if isinstance(per_group, tuple) and len(per_group) == count:
            value = per_group[index]
        if not per_model(spec):
            shared[parameter] = spec.validate(value)
            continue
        for position, model in enumerate(finetunes):
            if isinstance(value, Mapping):
                found = value.get(model)
            elif isinstance(value, Sequence) and not isinstance(value, str):
                found = value[position]
            else:
                found = value
            own[str(model)][parameter] = spec.validate(found)
    return Resolved(name, shared, own)


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


def _check_inputs(
    models: Mapping[Hashable, ModelLike], base: Hashable, strict: bool
) -> dict[Hashable, Mapping[str, torch.Tensor]]:
    """The same tensor names (``strict``) and shapes everywhere; identical non-floating buffers. The state dicts."""
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
    return states
