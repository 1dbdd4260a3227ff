"""The four methods as mergekit sees them: ordinary group methods whose lambda arrives as a parameter.

Each parameter is declared once, with its bounds (``mergekit_ram.parameters``), as a mergekit
``ParameterSpec``; mergekit binds and validates it. ``merge_group`` takes each fine-tune's lambda
from its own parameters: the ``lambda`` the merge step wrote into the recipe (with the ``rho`` it
came from), else the recipe's pins (1 for ``ram``, the ``scale`` for ``ram_unique``, 1 with
``r: 0``). An unpinned ``ram_plus`` lambda with r > 0 needs the global rho, counted before the
merge: a path that does not count it (mergekit's planner called directly) is refused in one line.

Two parameters are written by mergekit-ram's merge step, never by a recipe (``check_recipe`` refuses
them there): ``OUT_DTYPE``, the output dtype the kernel writes (the one rounding), and
``COUNTS_TO``, a file each group's counts are appended to, so a merge whose lambdas need no counts
is counted while it merges, without a second read and without state in this process.

A direct call (mergekit's ``merge_state_dicts``) passes the whole model: ``__call__`` counts it
first where a lambda needs the global rho (or a ``statistics_sink`` wants the statistics), then
hands mergekit the lambdas as parameters.
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
from mergekit_ram.kernel import MergeOverflowError, NonFiniteInputError, count_overlaps, merge_tensors
from mergekit_ram.lambdas import MergeRule, Resolved, merge_rule
from mergekit_ram.parameters import METHOD_PARAMETERS, SHARED_RULES, ParameterError
from mergekit_ram.rescaling import Rescaling
from mergekit_ram.stats.arithmetic import model_lambda
from mergekit_ram.stats.data import Pin, RamStatistics, TensorCounts
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
#: Written by mergekit-ram's merge step: the dtype the kernel writes the result in (None: the inputs').
OUT_DTYPE = "mergekit_ram_out_dtype"
#: Written by mergekit-ram's merge step: a file each group's counts are appended to (None: not counted).
COUNTS_TO = "mergekit_ram_counts_to"
HIDDEN_PARAMETERS = (OUT_DTYPE, COUNTS_TO)

StatisticsSink = Callable[[RamStatistics], None]


class RamMergeMethod(GroupMergeMethod):
    """One of mergekit-ram's methods on tensor groups (``ram``, ``ram_plus``, ``ram_ties``, ``ram_unique``):
    the kernel with the method's shared-region rule (``parameters.SHARED_RULES``); float32 (or float64) inside.

    ``statistics_sink``, when given, receives the statistics of each direct call
    (``mergekit_ram.merge_state_dicts`` passes one per call).
    """

    def __init__(self, name: str, statistics_sink: Optional[StatisticsSink] = None):
        self.statistics_sink = statistics_sink
        declared = tuple(
            ParameterSpec(
                name=info.name,
                value_type=info.value_type,
                scope=NON_BASE if info.per_model else SHARED,
                default=info.default,
            )
            for info in METHOD_PARAMETERS[name]
        )
        hidden = tuple(
            ParameterSpec(name=hidden, value_type=Optional[str], scope=SHARED, default=None)
            for hidden in HIDDEN_PARAMETERS
        )
        self.spec = MergeMethodSpec(
            name=name,
            pretty_name=PRETTY_NAMES[name],
            reference_url=REFERENCE_URL,
            contract=InputContract(base="required"),
            parameters=declared + hidden,
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
        """A direct call: the groups are the whole model. Counts first where a lambda needs the global rho
        (or the sink wants statistics), then mergekit's own call with each model's lambda as a parameter."""
        groups = tuple(groups)
        supplied = self._filled(dict(parameters or {}), groups)
        for group in groups:
            self.validate_inputs(
                [entry.id for entry in group.entries],
                group.base.id if group.base else None,
                group_name=group.metadata.name,
            )
            group.validate_tensors()
        resolved = [self._resolved(group, supplied, index, len(groups)) for index, group in enumerate(groups)]
        rule = merge_rule(self.spec.name, resolved)
        finetunes = list(dict.fromkeys(entry.id for group in groups for entry in group.non_base))
        needs_counts = rule.needs_counts(str(model) for model in finetunes)
        statistics = None
        if needs_counts or self.statistics_sink is not None:
            counts = [count_group(group, values.shared["epsilon"], dtype) for group, values in zip(groups, resolved)]
            statistics = rule.statistics(counts, "pre-pass" if needs_counts else "merge")
        if needs_counts:
            supplied.update(with_lambdas(rule, finetunes, statistics))
        supplied[OUT_DTYPE] = dtype_name(out_dtype)
        merged = super().__call__(
            groups, parameters=supplied, dtype=dtype, out_dtype=out_dtype, batch_options=batch_options
        )
        if self.statistics_sink is not None and statistics is not None:
            self.statistics_sink(statistics)
        return merged

    def _filled(self, parameters: dict[str, Any], groups: Sequence[Any]) -> dict[str, Any]:
        """A per-model mapping may name some models only (``{"lambda": {"coder": 1.2}}``): the others get
        the parameter's default (unpinned; a scale of 1), where mergekit would refuse the mapping."""
        models = list(dict.fromkeys(entry.id for group in groups for entry in group.non_base))
        for spec in self.spec.parameters:
            value = parameters.get(spec.name)
            if spec.scope == NON_BASE and isinstance(value, Mapping):
                parameters[spec.name] = {**dict.fromkeys(models, spec.default), **value}
        return parameters

    def _resolved(self, group: Any, parameters: Mapping[str, Any], index: int, count: int) -> Resolved:
        """The group's values of the declared parameters, as plain data (for ``merge_rule`` and the counts)."""
        shared: dict[str, Any] = {}
        per_model: dict[str, dict[str, Any]] = {str(entry.id): {} for entry in group.non_base}
        for spec in self.spec.parameters:
            value = _for_group(parameters.get(spec.name, spec.default), index, count)
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
        """One group (mergekit has cast it to the input dtype) merged with each model's lambda; its counts
        appended to ``COUNTS_TO`` when the merge step asks for them."""
        counts_to = parameters.get(COUNTS_TO)
        merged, counts = self.merge(group, parameters, self.lambdas(group, parameters), count=counts_to is not None)
        if counts_to is not None and counts is not None:
            append_counts(counts_to, counts)
        return merged

    def lambdas(self, group: Any, parameters: Mapping[str, Any]) -> list[float]:
        """Each fine-tune's lambda: its ``lambda`` parameter, else the rule on its pinned rho (1 with r = 0),
        its ``scale`` (ram_unique), 1 for ``ram``; an unpinned lambda that needs the global rho is refused."""
        rescaling = Rescaling(parameters["r"], parameters["alpha"], parameters["rule"]) if "r" in parameters else None
        found = []
        for entry in group.non_base:
            pin: Optional[tuple[Pin, float]] = None
            for kind in ("scale", "lambda", "rho"):
                value = parameters[kind][entry.id] if kind in parameters else None
                if value is not None:
                    pin = (kind, value)
                    break
            if pin is None and rescaling is not None and rescaling.r != 0:
                raise ParameterError(
                    f"{self.spec.name}: tensor {group.metadata.name}: the lambda of {entry.id} needs the global rho, "
                    "counted over the whole merge before it, which this way of calling mergekit does not count; "
                    "merge with mergekit-yaml, mergekit.merge.run_merge or mergekit_ram.merge_state_dicts, or pin "
                    "`lambda` or `rho` for every model, or set `r: 0`"
                )
            found.append(model_lambda(0.0, rescaling, pin))
        return found

    def merge(
        self, group: Any, parameters: Mapping[str, Any], lambdas: list[float], *, count: bool
    ) -> tuple[torch.Tensor, Optional[TensorCounts]]:
        """One group merged with each model's lambda (written in ``OUT_DTYPE`` when given), and its counts
        when ``count``."""
        try:
            result = merge_tensors(
                group.base.tensor,
                [entry.tensor for entry in group.non_base],
                parameters["epsilon"],
                lambdas,
                workers=torch.get_num_threads(),
                count=count,
                out_dtype=_dtype(parameters.get(OUT_DTYPE)),
                shared=SHARED_RULES[self.spec.name],
                density=parameters.get("density", 1.0),
            )
        except NonFiniteInputError as error:
            entry = group.base if error.index is None else group.non_base[error.index]
            dtype = entry.tensor.dtype
            raise non_finite_error(entry.id, group.metadata.name, dtype, dtype, error.value) from None
        except MergeOverflowError as error:
            raise self._overflow_error(group, parameters, lambdas, error) from None
        counts = tensor_counts(group, parameters["epsilon"], result.histograms) if count else None
        return result.merged, counts

    def _overflow_error(
        self, group: Any, parameters: Mapping[str, Any], lambdas: list[float], error: MergeOverflowError
    ) -> ParameterError:
        """Name the tensor and the cause of an overflow, with its fix: a model's update or the merged
        update (float64 arithmetic), its lambda (lower r or the pin), or the output dtype.

        A lambda with no rho beside it was pinned; one with a rho came from 1 + r * clip(rho).
        """
        name = group.metadata.name
        dtype = str(error.dtype).removeprefix("torch.")
        wider = "merge with `dtype: float64` (arithmetic is then float64)"
        if error.cause == "update" and error.index is not None:
            return ParameterError(
                f"{self.spec.name}: tensor {name}: the update of {group.non_base[error.index].id} "
                f"(its value minus the base's) overflows {dtype}; {wider}"
            )
        if error.cause == "lambda" and error.index is not None:
            entry = group.non_base[error.index]
            lam = lambdas[error.index]
            pinned = "r" not in parameters or (
                parameters["rho"].get(entry.id) is None and parameters["lambda"].get(entry.id) is not None
            )
            kind = "scale" if "scale" in parameters else "lambda"
            setting = (
                f"the pinned {kind} {lam!r} of {entry.id}"
                if pinned
                else f"lambda = 1 + r * clip(rho) = {lam!r} of {entry.id} (from r = {parameters['r']!r})"
            )
            return ParameterError(
                f"{self.spec.name}: tensor {name}: {setting} times its update, added to the base, does not fit "
                f"{dtype}; lower {kind if pinned else 'r'} (the paper's lambdas are about 1.2)"
            )
        if error.cause == "sum":
            return ParameterError(
                f"{self.spec.name}: tensor {name}: the merged update (the models' updates combined) overflows "
                f"{dtype}; {wider}"
            )
        return ParameterError(
            f"{self.spec.name}: tensor {name}: the merged values do not fit the output dtype {dtype} "
            "(out_dtype); choose a wider out_dtype"
        )


def with_lambdas(rule: MergeRule, finetunes: Sequence[Any], statistics: Optional[RamStatistics]) -> dict[str, Any]:
    """The per-model ``lambda`` and ``rho`` parameters (keyed by the models as given) the statistics give;
    an infinite rho (every change shared) is left out, as a parameter must be finite."""
    applied = rule.applied([str(model) for model in finetunes], statistics)
    rhos = {model: applied[str(model)].rho for model in finetunes}
    return {
        "lambda": {model: applied[str(model)].lambda_ for model in finetunes},
        "rho": {model: rho if rho is not None and math.isfinite(rho) else None for model, rho in rhos.items()},
    }


def count_group(group: Any, epsilon: float, dtype: Optional[torch.dtype] = None) -> TensorCounts:
    """A direct call's group counted (see ``count_tensors``)."""
    finetunes = [(entry.id, entry.tensor) for entry in group.non_base]
    return count_tensors(group.metadata.name or "", (group.base.id, group.base.tensor), finetunes, epsilon, dtype)


def count_tensors(
    name: str,
    base: tuple[Any, torch.Tensor],
    finetunes: Sequence[tuple[Any, torch.Tensor]],
    epsilon: float,
    dtype: Optional[torch.dtype] = None,
) -> TensorCounts:
    """One tensor's overlap counts on what the merge gets: the inputs cast to ``dtype``, else to their
    promoted dtype, as mergekit casts them for the method."""
    original = [tensor.dtype for _, tensor in (base, *finetunes)]
    target = dtype or functools.reduce(torch.promote_types, original)
    try:
        counted = count_overlaps(
            base[1].to(target), [tensor.to(target) for _, tensor in finetunes], epsilon, workers=torch.get_num_threads()
        )
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


def tensor_counts(group: Any, epsilon: float, histograms: Optional[tuple[tuple[int, ...], ...]]) -> TensorCounts:
    return TensorCounts(
        name=group.metadata.name or "",
        numel=group.base.tensor.numel(),
        epsilon=epsilon,
        models=tuple(str(entry.id) for entry in group.non_base),
        histograms=histograms or (),
    )


def append_counts(path: str, counts: TensorCounts) -> None:
    """One line of JSON per group, in one ``write`` on an append-only descriptor (threads may share the file)."""
    line = (json.dumps(counts_to_dict(counts)) + "\n").encode()
    descriptor = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        os.write(descriptor, line)
    finally:
        os.close(descriptor)


def read_counts(path: str) -> list[TensorCounts]:
    """The counts ``append_counts`` wrote to ``path`` (none when no group was counted)."""
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as handle:
        return [counts_from_dict(json.loads(line)) for line in handle if line.strip()]


def dtype_name(dtype: Optional[torch.dtype]) -> Optional[str]:
    return None if dtype is None else str(dtype).removeprefix("torch.")


def _dtype(name: Optional[str]) -> Optional[torch.dtype]:
    return None if name is None else getattr(torch, name)


def _for_group(value: Any, index: int, count: int) -> Any:
    """mergekit's ``PerGroupValues`` (one value per group of a direct call) read for group ``index``; a wrong
    number of values is left to mergekit's own binding to refuse."""
    values = getattr(value, "values", None)
    return values[index] if isinstance(values, tuple) and len(values) == count else value


def non_finite_error(
    model: Any, name: Optional[str], dtype: torch.dtype, original: torch.dtype, value: str
) -> InputError:
    """Name the model and tensor; an Inf in float16 is most likely the recipe's cast to it."""
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
