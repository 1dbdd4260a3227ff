"""The four methods as mergekit sees them: their specs, and one entry point into the kernel.

mergekit reaches a method's ``_execute`` from both of its paths, after its own binding and checks.
A task of the planned graph (the planner marks each with ``MODE``) brings one group whose lambdas
the pre-pass injected, or asks for the group's counts ("count": the pre-pass) or for the merge
and its counts together ("merge+count"). A direct call (mergekit's ``merge_state_dicts`` or
``merge_tensors``) brings groups that are the whole model: when a lambda needs it, the global rho
is counted over them all first. Either way lambda comes from one ``MergeSettings`` per call, and
the result is written once, in ``out_dtype`` when given.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from mergekit_ram.errors import InputError
from mergekit_ram.integration.internals import internal
from mergekit_ram.kernel import MergeOverflowError, NonFiniteInputError, count_overlaps, merge_tensors
from mergekit_ram.parameters import METHOD_PARAMETERS, SHARED_RULES, ParameterError, parameter_scopes
from mergekit_ram.planned import TensorParameters
from mergekit_ram.settings import merge_settings
from mergekit_ram.stats.data import RamStatistics, TensorCounts

GroupMergeMethod: Any = internal("mergekit.merge_methods.base", "GroupMergeMethod")
MergeMethodSpec: Any = internal("mergekit.merge_methods.base", "MergeMethodSpec")
InputContract: Any = internal("mergekit.merge_methods.base", "InputContract")
BasePolicy: Any = internal("mergekit.merge_methods.base", "BasePolicy")
ParameterSpec: Any = internal("mergekit.merge_methods.base", "ParameterSpec")
ParameterScope: Any = internal("mergekit.merge_methods.base", "ParameterScope")
BatchOptions: Any = internal("mergekit.merge_methods.base", "BatchOptions")
align_dtype: Any = internal("mergekit.merge_methods.dtype", "align_dtype")
internal("mergekit.merge_methods.base", "GroupMergeMethod._execute")  # overridden below: its signature checked
internal("mergekit.merge_methods.base", "MergeMethod._bind_per_input")

REFERENCE_URL = "https://arxiv.org/abs/2601.13572"
PRETTY_NAMES = {
    "ram": "Reinforced Agent Merging (RAM, mergekit-ram)",
    "ram_plus": "Reinforced Agent Merging Plus (RAM+, global rho, mergekit-ram)",
    "ram_ties": "Reinforced Agent Merging with a TIES shared region (mergekit-ram)",
    "ram_unique": "Reinforced Agent Merging, unique regions only (mergekit-ram)",
}
#: A parameter of the planned graph's merge tasks: what the task asks of the method ("merge",
#: "count", "merge+count"); absent in a direct call.
MODE = "mergekit_ram:task"

StatisticsSink = Callable[[RamStatistics], None]


class RamMergeMethod(GroupMergeMethod):
    """One of mergekit-ram's methods on tensor groups (``ram``, ``ram_plus``, ``ram_ties``, ``ram_unique``):
    the kernel with the method's shared-region rule (``parameters.SHARED_RULES``); float32 (or float64) inside.

    ``statistics_sink``, when given, receives the statistics of each direct call
    (``mergekit_ram.merge_state_dicts`` passes one per call).
    """

    def __init__(self, name: str, statistics_sink: Optional[StatisticsSink] = None):
        self.statistics_sink = statistics_sink
        self.spec = MergeMethodSpec(
            name=name,
            pretty_name=PRETTY_NAMES[name],
            reference_url=REFERENCE_URL,
            contract=InputContract(base=BasePolicy.REQUIRED),
            parameters=tuple(
                ParameterSpec(
                    name=info.name,
                    value_type=info.value_type,
                    scope=ParameterScope.NON_BASE if info.per_model else ParameterScope.SHARED,
                    default=info.default,
                )
                for info in METHOD_PARAMETERS[name]
            ),
        )

    def _bind_per_input(self, group: Any, parameter: Any, value: Any) -> Any:
        """A per-model mapping may name some models only (``{"lambda": {"coder": 1.2}}``): the others get
        the parameter's default (unpinned; a scale of 1), where mergekit would refuse the mapping."""
        if isinstance(value, Mapping):
            value = {**{entry.id: parameter.default for entry in group.non_base}, **value}
        return super()._bind_per_input(group, parameter, value)

    def merge_group(self, group: Any, /, **parameters: Any) -> torch.Tensor:
        """mergekit's one-group API, a direct call: the group is the whole model."""
        return self._execute((group,), [parameters], BatchOptions(), input_dtypes=[None])[0]

    def _execute(
        self,
        groups: Sequence[Any],
        parameters: list[dict[str, Any]],
        options: Any,
        *,
        input_dtypes: Sequence[Optional[torch.dtype]],
        out_dtype: Optional[torch.dtype] = None,
    ) -> tuple[Any, ...]:
        """Count, merge, or both (see the module's docstring); one result per group."""
        mode = parameters[0].get(MODE) if parameters else None
        if mode == "count":
            return tuple(self.count(*call) for call in zip(groups, parameters, input_dtypes))
        name = self.spec.name
        settings = merge_settings(name, [tensor_parameters(name, *call) for call in zip(groups, parameters)])
        finetunes = list(dict.fromkeys(str(entry.id) for group in groups for entry in group.non_base))
        statistics = None
        if settings.needs_counts(finetunes):  # a direct call: the groups are the whole model
            counts = [self.count(*call) for call in zip(groups, parameters, input_dtypes)]
            statistics = settings.statistics(counts, "pre-pass")
        lambdas = settings.lambdas(finetunes, statistics)
        counting = mode == "merge+count" or (self.statistics_sink is not None and statistics is None)
        results, counted = [], []
        for group, kwargs, dtype in zip(groups, parameters, input_dtypes):
            model_lambdas = [lambdas[str(entry.id)] for entry in group.non_base]
            merged, tensor_counts = self.merge(group, kwargs, dtype, out_dtype, model_lambdas, count=counting)
            results.append((merged, tensor_counts) if mode == "merge+count" else merged)
            counted.append(tensor_counts)
            del group, merged  # release each group's cast inputs before the next
        if self.statistics_sink is not None:
            self.statistics_sink(statistics or settings.statistics([c for c in counted if c is not None], "merge"))
        return tuple(results)

    def count(self, group: Any, parameters: Mapping[str, Any], dtype: Optional[torch.dtype]) -> TensorCounts:
        """The group's overlap counts, on the tensors the merge would get (cast to ``dtype``)."""
        original = {entry.id: entry.tensor.dtype for entry in group.entries}
        group = align_dtype(group, dtype)
        try:
            counted = count_overlaps(
                group.base.tensor,
                [entry.tensor for entry in group.non_base],
                parameters["epsilon"],
                workers=torch.get_num_threads(),
            )
        except NonFiniteInputError as error:
            raise _input_error(group, error, original) from None
        return _tensor_counts(group, parameters["epsilon"], counted.histograms)

    def merge(
        self,
        group: Any,
        parameters: Mapping[str, Any],
        dtype: Optional[torch.dtype],
        out_dtype: Optional[torch.dtype],
        lambdas: list[float],
        *,
        count: bool,
    ) -> tuple[torch.Tensor, Optional[TensorCounts]]:
        """One group merged with each model's lambda (written in ``out_dtype``), and its counts when ``count``."""
        original = {entry.id: entry.tensor.dtype for entry in group.entries}
        group = align_dtype(group, dtype)
        try:
            result = merge_tensors(
                group.base.tensor,
                [entry.tensor for entry in group.non_base],
                parameters["epsilon"],
                lambdas,
                workers=torch.get_num_threads(),
                count=count,
                out_dtype=out_dtype,
                shared=SHARED_RULES[self.spec.name],
                density=parameters.get("density", 1.0),
            )
        except NonFiniteInputError as error:
            raise _input_error(group, error, original) from None
        except MergeOverflowError as error:
            raise self._overflow_error(group, parameters, lambdas, error) from None
        counts = _tensor_counts(group, parameters["epsilon"], result.histograms) if count else None
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


def tensor_parameters(method: str, group: Any, parameters: Mapping[str, Any]) -> TensorParameters:
    """A group's bound parameters as plain data (for ``merge_settings``)."""
    _, per_model = parameter_scopes(method)
    models = {
        str(entry.id): {name: parameters[name].get(entry.id) for name in per_model if name in parameters}
        for entry in group.non_base
    }
    return TensorParameters.of(method, group.metadata.name or "", parameters, models)


def _tensor_counts(group: Any, epsilon: float, histograms: Optional[tuple[tuple[int, ...], ...]]) -> TensorCounts:
    return TensorCounts(
        name=group.metadata.name or "",
        numel=group.base.tensor.numel(),
        epsilon=epsilon,
        models=tuple(str(entry.id) for entry in group.non_base),
        histograms=histograms or (),
    )


def _input_error(group: Any, error: NonFiniteInputError, original: Mapping[Any, torch.dtype]) -> InputError:
    """Name the model and tensor; an Inf in float16 is most likely the recipe's cast to it."""
    entry = group.base if error.index is None else group.non_base[error.index]
    name = group.metadata.name
    dtype = entry.tensor.dtype
    if error.value == "Inf" and dtype == torch.float16:
        if original.get(entry.id, dtype) != dtype:
            cause = f"after the cast from {str(original[entry.id]).removeprefix('torch.')} to float16 (dtype)"
        else:
            cause = "as float16 (after the recipe's `dtype: float16` cast, if the checkpoint is wider)"
        return InputError(
            f"{entry.id}: tensor {name} is Inf {cause}; values above 65504 do not fit float16: "
            "merge with `dtype: bfloat16` or `float32`"
        )
    return InputError(f"{entry.id}: tensor {name} contains NaN or Inf")


METHODS = {name: RamMergeMethod(name) for name in METHOD_PARAMETERS}
