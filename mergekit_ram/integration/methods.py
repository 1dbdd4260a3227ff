"""The four methods as mergekit group methods; each fine-tune's lambda arrives as a per-model parameter
(written into the recipe, or pinned). A direct call (``merge_state_dicts``) counts the whole model first
where a lambda needs the global rho; a path that counts nothing refuses such a lambda.
"""

from __future__ import annotations

import functools
import json
import math
import os
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from mergekit_ram.errors import InputError
from mergekit_ram.integration.internals import internal
from mergekit_ram.kernel import (
    MergeOverflowError,
    MergeResult,
    NonFiniteInputError,
    compute_dtype,
    count_overlaps,
    merge_tensors,
)
from mergekit_ram.lambdas import Resolved, merge_rule
from mergekit_ram.parameters import METHOD_PARAMETERS, SHARED_RULES, ParameterError, ParameterInfo
from mergekit_ram.rescaling import Rescaling
from mergekit_ram.stats.arithmetic import model_lambda
from mergekit_ram.stats.data import PIN_KINDS, RamStatistics, TensorCounts
from mergekit_ram.stats.schema import counts_from_dict, counts_to_dict

GroupMergeMethod: Any = internal("mergekit.merge_methods.base", "GroupMergeMethod")
MergeMethodSpec: Any = internal("mergekit.merge_methods.base", "MergeMethodSpec")
InputContract: Any = internal("mergekit.merge_methods.base", "InputContract")
ParameterSpec: Any = internal("mergekit.merge_methods.base", "ParameterSpec")
#: mergekit's ``ParameterScope`` and ``BasePolicy`` are ``str`` enums: their values are enough.
SHARED, NON_BASE = "shared", "non_base"

REFERENCE_URL = "https://arxiv.org/abs/2601.13572"
PRETTY_NAMES = {
    "ram": "Reinforced Agent Merging (RAM, mergekit-ram)",
    "ram_plus": "Reinforced Agent Merging Plus (RAM+, global rho, mergekit-ram)",
    "ram_ties": "Reinforced Agent Merging with a TIES shared region (mergekit-ram)",
    "ram_unique": "Reinforced Agent Merging, unique regions only (mergekit-ram)",
}
#: Written by the merge step, never by a recipe: the kernel's output dtype and the file counts are appended to.
OUT_DTYPE = "mergekit_ram_out_dtype"
COUNTS_TO = "mergekit_ram_counts_to"
HIDDEN_PARAMETERS = (OUT_DTYPE, COUNTS_TO)


class RamMergeMethod(GroupMergeMethod):
    """One method on tensor groups; ``statistics_sink`` receives each direct call's statistics."""

    def __init__(self, name: str, statistics_sink: Optional[Callable[[RamStatistics], None]] = None):
        self.statistics_sink = statistics_sink
        hidden = [ParameterInfo(hidden, Optional[str], None, "") for hidden in HIDDEN_PARAMETERS]
        self.spec = MergeMethodSpec(
            name=name,
            pretty_name=PRETTY_NAMES[name],
            reference_url=REFERENCE_URL,
            contract=InputContract(base="required"),
            parameters=tuple(
                ParameterSpec(
                    name=info.name,
                    value_type=info.value_type,
                    scope=NON_BASE if info.per_model else SHARED,
                    default=info.default,
                )
                for info in (*METHOD_PARAMETERS[name], *hidden)
            ),
        )

    def __call__(
        self,
        groups: Sequence[Any],
        /,
        *,
        parameters: Optional[Mapping[str, Any]] = None,
        dtype: Optional[torch.dtype] = None,
        out_dtype: Optional[torch.dtype] = None,
        batch_options: Any = None,
    ) -> tuple[torch.Tensor, ...]:
        """A direct call (the whole model): counted first where a lambda needs the global rho or the sink."""
        groups = tuple(groups)
        finetunes = list(dict.fromkeys(entry.id for group in groups for entry in group.non_base))
        supplied = self._filled(dict(parameters or {}), finetunes)
        for group in groups:
            self.validate_inputs(
                [entry.id for entry in group.entries],
                group.base.id if group.base else None,
                group_name=group.metadata.name,
            )
            group.validate_tensors()
        resolved = [self._resolved(group, supplied, index, len(groups)) for index, group in enumerate(groups)]
        rule = merge_rule(self.spec.name, resolved)
        needs_counts = rule.needs_counts(str(model) for model in finetunes)
        statistics = None
        if needs_counts or self.statistics_sink is not None:
            counts = [count_group(group, values.shared["epsilon"], dtype) for group, values in zip(groups, resolved)]
            statistics = rule.statistics(counts, "pre-pass" if needs_counts else "merge")
        if needs_counts:  # an infinite rho is left out: parameters are finite
            applied = rule.applied([str(model) for model in finetunes], statistics)
            supplied["lambda"] = {model: applied[str(model)].lambda_ for model in finetunes}
            supplied["rho"] = {model: finite(applied[str(model)].rho) for model in finetunes}
        supplied[OUT_DTYPE] = None if out_dtype is None else str(out_dtype).removeprefix("torch.")
        merged = super().__call__(
            groups, parameters=supplied, dtype=dtype, out_dtype=out_dtype, batch_options=batch_options
        )
        if self.statistics_sink is not None and statistics is not None:
            self.statistics_sink(statistics)
        return merged

    def _filled(self, parameters: dict[str, Any], models: Sequence[Any]) -> dict[str, Any]:
        """A per-model mapping naming some models only: the others get the default (mergekit would refuse it)."""
        for spec in self.spec.parameters:
            value = parameters.get(spec.name)
            if spec.scope == NON_BASE and isinstance(value, Mapping):
                parameters[spec.name] = {**dict.fromkeys(models, spec.default), **value}
        return parameters

    def _resolved(self, group: Any, parameters: Mapping[str, Any], index: int, count: int) -> Resolved:
        """The group's values of the declared parameters, as plain data."""
        shared: dict[str, Any] = {}
        per_model: dict[str, dict[str, Any]] = {str(entry.id): {} for entry in group.non_base}
        for spec in self.spec.parameters:
            value = parameters.get(spec.name, spec.default)
            per_group = getattr(value, "values", None)  # mergekit's PerGroupValues: mergekit refuses a wrong count
            if isinstance(per_group, tuple) and len(per_group) == count:
                value = per_group[index]
            if spec.scope == SHARED:
                shared[spec.name] = spec.validate(value)
                continue
            for position, entry in enumerate(group.non_base):
                if isinstance(value, Mapping):
                    own = value.get(entry.id)
                elif isinstance(value, Sequence) and not isinstance(value, str):
                    own = value[position]
                else:
                    own = value
                per_model[str(entry.id)][spec.name] = spec.validate(own)
        return Resolved(group.metadata.name or "", shared, per_model)

    def merge_group(self, group: Any, /, **parameters: Any) -> torch.Tensor:
        """One group merged; its counts appended to ``COUNTS_TO`` when the merge step asks for them."""
        counts_to = parameters.get(COUNTS_TO)
        result = self.merge(group, parameters, self.lambdas(group, parameters), count=counts_to is not None)
        if counts_to is not None:
            counts = TensorCounts(
                name=group.metadata.name or "",
                numel=group.base.tensor.numel(),
                epsilon=parameters["epsilon"],
                models=tuple(str(entry.id) for entry in group.non_base),
                histograms=result.histograms or (),
            )
            append_counts(counts_to, counts)
        return result.merged

    def lambdas(self, group: Any, parameters: Mapping[str, Any]) -> list[float]:
        """Each fine-tune's lambda from its pin (scale, lambda or rho); one that needs the global rho is refused."""
        rescaling = Rescaling(parameters["r"], parameters["alpha"], parameters["rule"]) if "r" in parameters else None
        found = []
        for entry in group.non_base:
            pins = [(kind, parameters[kind][entry.id]) for kind in PIN_KINDS if kind in parameters]
            pin = next(((kind, value) for kind, value in pins if value is not None), None)
            if pin is None and rescaling is not None and rescaling.r != 0:
                raise ParameterError(
                    f"{self.spec.name}: tensor {group.metadata.name}: the lambda of {entry.id} needs the global rho, "
                    "counted over the whole merge before it, which this way of calling mergekit does not count; "
                    "merge with mergekit-yaml, mergekit.merge.run_merge or mergekit_ram.merge_state_dicts, or pin "
                    "`lambda` or `rho` for every model, or set `r: 0`"
                )
            found.append(model_lambda(0.0, rescaling, pin))
        return found

    def merge(self, group: Any, parameters: Mapping[str, Any], lambdas: list[float], *, count: bool) -> MergeResult:
        try:
            return merge_tensors(
                group.base.tensor,
                [entry.tensor for entry in group.non_base],
                parameters["epsilon"],
                lambdas,
                count=count,
                out_dtype=None if parameters.get(OUT_DTYPE) is None else getattr(torch, parameters[OUT_DTYPE]),
                shared=SHARED_RULES[self.spec.name],
                density=parameters.get("density", 1.0),
            )
        except NonFiniteInputError as error:
            entry = group.base if error.index is None else group.non_base[error.index]
            dtype = entry.tensor.dtype
            raise non_finite_error(entry.id, group.metadata.name, dtype, dtype, error.value) from None
        except MergeOverflowError as error:
            raise self._overflow_error(group, error) from None

    def _overflow_error(self, group: Any, error: MergeOverflowError) -> ParameterError:
        """The tensor and the fix of a NaN or Inf result from finite weights: a wider out_dtype where only the
        rounding to it overflowed, else float64 arithmetic."""
        dtype = str(error.dtype).removeprefix("torch.")
        inputs = compute_dtype(group.base.tensor.dtype, *(entry.tensor.dtype for entry in group.non_base))
        if error.dtype != inputs:
            return ParameterError(
                f"{self.spec.name}: tensor {group.metadata.name}: the merged values do not fit the output dtype "
                f"{dtype} (out_dtype); choose a wider out_dtype"
            )
        return ParameterError(
            f"{self.spec.name}: tensor {group.metadata.name}: the merged values overflow {dtype}; merge with "
            "`dtype: float64` (arithmetic is then float64)"
        )


def count_group(group: Any, epsilon: float, dtype: Optional[torch.dtype]) -> TensorCounts:
    finetunes = [(entry.id, entry.tensor) for entry in group.non_base]
    return count_tensors(group.metadata.name or "", (group.base.id, group.base.tensor), finetunes, epsilon, dtype)


def count_tensors(
    name: str,
    base: tuple[Any, torch.Tensor],
    finetunes: Sequence[tuple[Any, torch.Tensor]],
    epsilon: float,
    dtype: Optional[torch.dtype],
) -> TensorCounts:
    """One tensor's counts on the inputs cast to ``dtype`` (else their promoted dtype), as mergekit casts them."""
    original = [tensor.dtype for _, tensor in (base, *finetunes)]
    target = dtype or functools.reduce(torch.promote_types, original)
    try:
        counted = count_overlaps(base[1].to(target), [tensor.to(target) for _, tensor in finetunes], epsilon)
    except NonFiniteInputError as error:
        index = 0 if error.index is None else error.index + 1
        model = (base, *finetunes)[index][0]
        raise non_finite_error(model, name, target, original[index], error.value) from None
    return TensorCounts(
        name=name,
        numel=base[1].numel(),
        epsilon=epsilon,
        models=tuple(str(model) for model, _ in finetunes),
        histograms=counted.histograms or (),
    )


def append_counts(path: str, counts: TensorCounts) -> None:
    """One line of JSON per group, in one unbuffered append (threads may share the file)."""
    with open(path, "ab", buffering=0, opener=lambda file, flags: os.open(file, flags, 0o600)) as handle:
        handle.write((json.dumps(counts_to_dict(counts)) + "\n").encode())


def finite(value: Optional[float]) -> Optional[float]:
    """``value`` where it is a finite number (an infinite rho is not handed to a method), else None."""
    return value if value is not None and math.isfinite(value) else None


def read_counts(path: str) -> list[TensorCounts]:
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as handle:
        return [counts_from_dict(json.loads(line)) for line in handle if line.strip()]


def non_finite_error(
    model: Any, name: Optional[str], dtype: torch.dtype, original: torch.dtype, value: str
) -> InputError:
    """An Inf in float16 is most likely the recipe's cast to it."""
    if value == "Inf" and dtype == torch.float16:
        if original != dtype:
            cause = f"after the cast from {str(original).removeprefix('torch.')} to float16 (dtype)"
        else:
            cause = "as float16 (after the recipe's `dtype: float16` cast, if the checkpoint is wider)"
        return InputError(
            f"{model}: tensor {name} is Inf {cause}; values above 65504 do not fit float16: "
            "merge with `dtype: bfloat16` or `float32`"
        )
    return InputError(f"{model}: tensor {name} contains NaN or Inf")


METHODS = {name: RamMergeMethod(name) for name in METHOD_PARAMETERS}
