"""The ``ram`` and ``ram_plus`` merge methods as mergekit sees them: specs and the call into the kernel.

mergekit reaches a method two ways. The planned graph calls ``_execute_resolved`` with one
tensor group whose parameters the pre-pass has given each model's lambda (and the rho it
came from). mergekit's in-memory API (``merge_state_dicts``) calls the method with every
group of the model at once, so ``__call__`` counts the global rho over them all first.
Either way lambda comes from one ``MergeSettings`` per merge, and the result is written
once, in ``out_dtype`` when given.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence

import torch
from mergekit.merge_methods.base import (
    BasePolicy,
    BatchOptions,
    GroupMergeMethod,
    InputContract,
    MergeMethodSpec,
    ParameterScope,
    ParameterSpec,
    PerInputValues,
    TensorGroup,
)
from mergekit.merge_methods.dtype import align_dtype, promoted_dtype

from mergekit_ram.errors import InputError, RamError
from mergekit_ram.kernel import MergeOverflowError, NonFiniteInputError, count_overlaps, merge_tensors
from mergekit_ram.parameters import METHOD_PARAMETERS, SHARED_RULES, ParameterError, parameter_scopes
from mergekit_ram.planned import TensorParameters
from mergekit_ram.settings import Applied, merge_settings
from mergekit_ram.stats.data import RamStatistics, TensorCounts

REFERENCE_URL = "https://arxiv.org/abs/2601.13572"
PRETTY_NAMES = {
    "ram": "Reinforced Agent Merging (RAM, mergekit-ram)",
    "ram_plus": "Reinforced Agent Merging Plus (RAM+, global rho, mergekit-ram)",
    "ram_ties": "Reinforced Agent Merging with a TIES shared region (mergekit-ram)",
    "ram_unique": "Reinforced Agent Merging, unique regions only (mergekit-ram)",
}

StatisticsSink = Callable[[RamStatistics], None]


class MissingStatisticsError(RamError, RuntimeError):
    """ram_plus was asked to merge without a model's global rho or lambda."""


class RamMergeMethod(GroupMergeMethod):
    """One of mergekit-ram's methods on tensor groups (``ram``, ``ram_plus``, ``ram_ties``, ``ram_unique``):
    the kernel with the method's shared-region rule (``parameters.SHARED_RULES``); float32 (or float64) inside.

    ``statistics_sink``, when given, receives the statistics of each in-memory call (mergekit's
    ``merge_state_dicts``); ``mergekit_ram.merge_state_dicts`` passes one per call.
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

    # mergekit's entry points ---------------------------------------------------------------

    def __call__(
        self,
        groups: Sequence[TensorGroup],
        /,
        *,
        parameters: Optional[Mapping[str, Any]] = None,
        dtype: Optional[torch.dtype] = None,
        out_dtype: Optional[torch.dtype] = None,
        batch_options: Optional[BatchOptions] = None,
    ) -> tuple[torch.Tensor, ...]:
        """The in-memory entry point: the groups are the whole model, so rho is global over them."""
        groups = tuple(groups)
        if not all(isinstance(group, TensorGroup) for group in groups):
            raise TypeError("Merge inputs must be a sequence of TensorGroup values")
        for name, value in (("dtype", dtype), ("out_dtype", out_dtype)):
            if value is not None and (not isinstance(value, torch.dtype) or not value.is_floating_point):
                raise ValueError(f"{name} must be a floating-point torch.dtype")
        bound = self._bind_parameters(groups, parameters or {})  # mergekit's checks of groups and values
        input_dtypes = [(dtype or promoted_dtype(group)) if group.entries else dtype for group in groups]
        settings = merge_settings(
            self.spec.name, [tensor_parameters(self.spec.name, group, kwargs) for group, kwargs in zip(groups, bound)]
        )
        finetunes = list(dict.fromkeys(str(entry.id) for group in groups for entry in group.non_base))
        statistics = None
        if settings.needs_counts(finetunes):
            counts = [self.count(group, kwargs, dtype) for group, kwargs, dtype in zip(groups, bound, input_dtypes)]
            statistics = settings.statistics(counts, "pre-pass")
        applied = settings.applied(finetunes, statistics)
        bound = [with_lambdas(group, kwargs, applied) for group, kwargs in zip(groups, bound)]
        collect = self.statistics_sink is not None and statistics is None
        results, counts = self._merge_groups(groups, bound, input_dtypes, out_dtype, count=collect)
        if self.statistics_sink is not None:
            self.statistics_sink(statistics or settings.statistics(counts, "merge"))
        return results

    def _execute(
        self,
        groups: Sequence[TensorGroup],
        parameters: list[dict[str, Any]],
        options: BatchOptions,
        *,
        input_dtypes: Sequence[Optional[torch.dtype]],
        out_dtype: Optional[torch.dtype] = None,
    ) -> tuple[torch.Tensor, ...]:
        """The planned graph's entry point: one group, lambdas given by the pre-pass."""
        return self._merge_groups(groups, parameters, input_dtypes, out_dtype, count=False)[0]

    def merge_group(self, group: TensorGroup, /, **parameters: Any) -> torch.Tensor:
        """mergekit's one-group API: lambdas from this group's own parameters."""
        return self.merge(group, parameters, None, None, count=False)[0]

    # Used by the graph tasks of the pre-pass -----------------------------------------------

    def count(self, group: TensorGroup, parameters: Mapping[str, Any], dtype: Optional[torch.dtype]) -> TensorCounts:
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
        return tensor_counts(group, parameters["epsilon"], counted.histograms)

    def merge(
        self,
        group: TensorGroup,
        parameters: Mapping[str, Any],
        dtype: Optional[torch.dtype],
        out_dtype: Optional[torch.dtype],
        *,
        count: bool,
    ) -> tuple[torch.Tensor, Optional[TensorCounts]]:
        """One group merged (written in ``out_dtype``), and its counts when ``count``."""
        original = {entry.id: entry.tensor.dtype for entry in group.entries}
        group = align_dtype(group, dtype)
        lambdas = self.lambdas(group, parameters)
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
        counts = tensor_counts(group, parameters["epsilon"], result.histograms) if count else None
        return result.merged, counts

    def lambdas(self, group: TensorGroup, parameters: Mapping[str, Any]) -> Optional[list[float]]:
        """lambda_t per fine-tune as given (injected by the pre-pass, or pinned; ram_unique: each
        model's scale); None for RAM.

        A group merged on its own (``merge_group``) gets them from its own parameters, through
        the same ``MergeSettings``; a model that needs a global rho it was not given is an error.
        """
        if self.spec.name == "ram":
            return None
        injected = parameters.get("lambda", {})
        given = [injected.get(entry.id) for entry in group.non_base]
        if all(value is not None for value in given):
            return given
        settings = merge_settings(self.spec.name, [tensor_parameters(self.spec.name, group, parameters)])
        own = settings.lambdas_without_counts([str(entry.id) for entry in group.non_base])
        if own is None:
            missing = next(entry.id for entry, value in zip(group.non_base, given) if value is None)
            raise MissingStatisticsError(
                f"{self.spec.name} has no global rho for {missing} while merging {group.metadata.name}: "
                "the whole-model pre-pass did not run on this path. Merge with mergekit-yaml, "
                "mergekit-multi, mergekit-pytorch or mergekit.merge.run_merge with mergekit-ram "
                "registered, call the method with every tensor group at once "
                "(mergekit.merge_methods.merge_state_dicts or mergekit_ram.merge_state_dicts), or "
                "pin `rho` or `lambda` for each model in the recipe."
            )
        return [own[str(entry.id)] for entry in group.non_base]

    # Internals -------------------------------------------------------------------------------

    def _merge_groups(
        self,
        groups: Sequence[TensorGroup],
        parameters: Sequence[Mapping[str, Any]],
        input_dtypes: Sequence[Optional[torch.dtype]],
        out_dtype: Optional[torch.dtype],
        *,
        count: bool,
    ) -> tuple[tuple[torch.Tensor, ...], list[TensorCounts]]:
        results, counts = [], []
        for group, kwargs, dtype in zip(groups, parameters, input_dtypes):
            merged, tensor_count = self.merge(group, kwargs, dtype, out_dtype, count=count)
            if tensor_count is not None:
                counts.append(tensor_count)
            results.append(merged)
            del group, merged  # release each group's cast inputs before the next
        return tuple(results), counts

    def _overflow_error(
        self,
        group: TensorGroup,
        parameters: Mapping[str, Any],
        lambdas: Optional[list[float]],
        error: MergeOverflowError,
    ) -> ParameterError:
        """Name the tensor and the setting behind an overflow: lambda (or r), or a dtype.

        A lambda with no rho beside it was pinned; one with a rho came from 1 + r * clip(rho).
        """
        name = group.metadata.name
        dtype = str(error.dtype).removeprefix("torch.")
        if error.cause == "lambda" and error.index is not None and lambdas is not None:
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
                f"{self.spec.name}: tensor {name}: {setting} times its update does not fit {dtype}; "
                f"lower {kind if pinned else 'r'} (the paper's lambdas are about 1.2)"
            )
        if error.cause == "sum":
            return ParameterError(
                f"{self.spec.name}: tensor {name}: the merged update overflows {dtype}; "
                "merge with `dtype: float64` (arithmetic is then float64)"
            )
        return ParameterError(
            f"{self.spec.name}: tensor {name}: the merged values do not fit the output dtype {dtype} "
            "(out_dtype); choose a wider out_dtype"
        )


def tensor_parameters(method: str, group: TensorGroup, parameters: Mapping[str, Any]) -> TensorParameters:
    """A group's bound parameters as plain data (for ``merge_settings``): the method's whole-merge
    and per-model parameters, as the parameter table declares them."""
    shared, per_model = parameter_scopes(method)
    return TensorParameters(
        name=group.metadata.name or "",
        shared=tuple((name, parameters[name]) for name in shared if name in parameters),
        per_model=tuple(
            (str(entry.id), tuple((name, parameters[name].get(entry.id)) for name in per_model if name in parameters))
            for entry in group.non_base
        ),
    )


def with_lambdas(group: TensorGroup, parameters: Mapping[str, Any], applied: Mapping[str, Applied]) -> dict[str, Any]:
    """The group's parameters with each model's lambda, and the rho it came from (None when pinned)."""
    if not applied:
        return dict(parameters)
    return {
        **parameters,
        "lambda": PerInputValues([(entry.id, applied[str(entry.id)].lambda_) for entry in group.non_base]),
        "rho": PerInputValues([(entry.id, applied[str(entry.id)].rho) for entry in group.non_base]),
    }


def tensor_counts(
    group: TensorGroup, epsilon: float, histograms: Optional[tuple[tuple[int, ...], ...]]
) -> TensorCounts:
    return TensorCounts(
        name=group.metadata.name or "",
        numel=group.base.tensor.numel(),
        epsilon=epsilon,
        models=tuple(str(entry.id) for entry in group.non_base),
        histograms=histograms or (),
    )


def _input_error(group: TensorGroup, error: NonFiniteInputError, original: Mapping[Any, torch.dtype]) -> InputError:
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
