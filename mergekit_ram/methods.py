"""The ``ram`` and ``ram_plus`` merge methods as mergekit sees them: specs and kernels.

Only mergekit's public method API is used here. The pre-pass reaches the kernel through
``count_request``: a task that runs a merge task's own inputs sets it, so the counts are
taken from exactly what the kernel receives (slices, filters, dtype casts, tokenizer
alignment included).
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

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
from mergekit.merge_methods.dtype import align_dtype

from mergekit_ram.checks import InputError
from mergekit_ram.errors import RamError
from mergekit_ram.kernel import (
    Histograms,
    MergeOverflowError,
    NonFiniteInputError,
    count_overlaps,
    merge_tensors,
    rescale_factor,
)
from mergekit_ram.parameters import METHOD_PARAMETERS, ParameterError
from mergekit_ram.stats import Pin, RamStatistics, TensorCounts

REFERENCE_URL = "https://arxiv.org/abs/2601.13572"
PRETTY_NAMES = {
    "ram": "Reinforced Agent Merging (RAM, mergekit-ram)",
    "ram_plus": "Reinforced Agent Merging Plus (RAM+, global rho, mergekit-ram)",
}


@dataclass
class CountRequest:
    """Asks the kernel for the overlap counts of the group it is given.

    ``merge=False`` is the pre-pass: count only and return the base unchanged.
    """

    merge: bool
    counts: Optional[TensorCounts] = None


_COUNT_REQUEST: ContextVar[Optional[CountRequest]] = ContextVar("mergekit_ram_count_request", default=None)


@contextlib.contextmanager
def count_request(merge: bool) -> Iterator[CountRequest]:
    request = CountRequest(merge=merge)
    token = _COUNT_REQUEST.set(request)
    try:
        yield request
    finally:
        _COUNT_REQUEST.reset(token)


class MissingStatisticsError(RamError, RuntimeError):
    """ram_plus was asked to merge without a model's global rho or lambda."""


@dataclass
class StatisticsRequest:
    """Asks a whole-call merge (mergekit's ``merge_state_dicts``) for its statistics."""

    statistics: Optional[RamStatistics] = None


_STATISTICS_REQUEST: ContextVar[Optional[StatisticsRequest]] = ContextVar("mergekit_ram_statistics", default=None)
#: Set while mergekit's public ``method(groups, ...)`` runs: the call holds the whole model.
_WHOLE_CALL: ContextVar[bool] = ContextVar("mergekit_ram_whole_call", default=False)


@contextlib.contextmanager
def statistics_request() -> Iterator[StatisticsRequest]:
    request = StatisticsRequest()
    token = _STATISTICS_REQUEST.set(request)
    try:
        yield request
    finally:
        _STATISTICS_REQUEST.reset(token)


class RamMergeMethod(GroupMergeMethod):
    """RAM (``ram``) or RAM+ (``ram_plus``) on tensor groups; float32 (or float64) inside.

    Two entry points, both mergekit's: the graph calls ``_execute_resolved`` with one group
    (the pre-pass has put each model's global rho in its parameters); the in-memory API
    calls the method with every group of the model, so ``ram_plus`` counts rho over them all
    first. Either way the result is written once, in ``out_dtype`` when given.
    """

    def __init__(self, name: str):
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
        """mergekit's in-memory entry point: the groups are the whole model (global rho)."""
        token = _WHOLE_CALL.set(True)
        try:
            return super().__call__(
                groups, parameters=parameters, dtype=dtype, out_dtype=out_dtype, batch_options=batch_options
            )
        finally:
            _WHOLE_CALL.reset(token)

    def _execute(
        self,
        groups: Sequence[TensorGroup],
        parameters: list[dict[str, Any]],
        options: BatchOptions,
        *,
        input_dtypes: Sequence[Optional[torch.dtype]],
        out_dtype: Optional[torch.dtype] = None,
    ) -> tuple[torch.Tensor, ...]:
        """Each group cast to its input dtype (mergekit's rule), merged, written in ``out_dtype``."""
        whole_call = _WHOLE_CALL.get() and _COUNT_REQUEST.get() is None
        request = _STATISTICS_REQUEST.get() if whole_call else None
        counts: list[TensorCounts] = []
        statistics = None
        if whole_call and self.needs_global_rho(groups, parameters):
            counts = [
                self._count(group, kwargs, dtype) for group, kwargs, dtype in zip(groups, parameters, input_dtypes)
            ]
            statistics = self._statistics(parameters, counts, "pre-pass")
            bound = [_with_rho(group, kwargs, statistics) for group, kwargs in zip(groups, parameters)]
        else:
            bound = list(parameters)
        collect = request is not None and statistics is None
        results = []
        for group, kwargs, dtype in zip(groups, bound, input_dtypes):
            merged, tensor_counts = self._merge(group, kwargs, dtype, out_dtype, count=collect)
            if tensor_counts is not None:
                counts.append(tensor_counts)
            results.append(merged)
            del group, merged  # release each group's cast inputs before the next
        if request is not None:
            request.statistics = statistics or self._statistics(parameters, counts, "merge")
        return tuple(results)

    def merge_group(self, group: TensorGroup, /, **parameters: Any) -> torch.Tensor:
        return self._merge(group, parameters, None, None, count=False)[0]

    def needs_global_rho(self, groups: Sequence[TensorGroup], parameters: Sequence[dict[str, Any]]) -> bool:
        """ram_plus with r > 0 and some model with neither rho nor lambda pinned."""
        if self.spec.name == "ram":
            return False
        return any(
            kwargs["r"] != 0 and kwargs["lambda"].get(entry.id) is None and kwargs["rho"].get(entry.id) is None
            for group, kwargs in zip(groups, parameters)
            for entry in group.non_base
        )

    def _count(self, group: TensorGroup, parameters: dict[str, Any], dtype: Optional[torch.dtype]) -> TensorCounts:
        original = {entry.id: entry.tensor.dtype for entry in group.entries}
        group = align_dtype(group, dtype)
        return self._counts(group, parameters, original)

    def _merge(
        self,
        group: TensorGroup,
        parameters: dict[str, Any],
        dtype: Optional[torch.dtype],
        out_dtype: Optional[torch.dtype],
        *,
        count: bool,
    ) -> tuple[torch.Tensor, Optional[TensorCounts]]:
        """One group: the merged tensor (the base when only counting for the pre-pass), its counts."""
        original = {entry.id: entry.tensor.dtype for entry in group.entries}
        group = align_dtype(group, dtype)
        request = _COUNT_REQUEST.get()
        if request is not None and not request.merge:
            request.counts = self._counts(group, parameters, original)
            return group.base.tensor, request.counts
        lambdas = self.lambdas(group, parameters)
        count = count or request is not None
        with self._named_errors(group, parameters, lambdas, original):
            result = merge_tensors(
                group.base.tensor,
                [entry.tensor for entry in group.non_base],
                parameters["epsilon"],
                lambdas,
                workers=torch.get_num_threads(),
                count=count,
                out_dtype=out_dtype,
            )
        counts = _tensor_counts(group, parameters, result.histograms) if result.histograms is not None else None
        if request is not None:
            request.counts = counts
        return result.merged, counts

    def _counts(
        self, group: TensorGroup, parameters: dict[str, Any], original: Mapping[Any, torch.dtype]
    ) -> TensorCounts:
        """The group's overlap counts, without merging."""
        with self._named_errors(group, parameters, None, original):
            result = count_overlaps(
                group.base.tensor,
                [entry.tensor for entry in group.non_base],
                parameters["epsilon"],
                workers=torch.get_num_threads(),
            )
        return _tensor_counts(group, parameters, result.histograms)

    @contextlib.contextmanager
    def _named_errors(
        self,
        group: TensorGroup,
        parameters: dict[str, Any],
        lambdas: Optional[list[float]],
        original: Mapping[Any, torch.dtype],
    ) -> Iterator[None]:
        """The kernel's errors as the plugin's: they name the model, the tensor and the setting."""
        try:
            yield
        except NonFiniteInputError as error:
            raise _input_error(group, error, original) from None
        except MergeOverflowError as error:
            raise self._overflow_error(group, parameters, lambdas, error) from None

    def _overflow_error(
        self,
        group: TensorGroup,
        parameters: dict[str, Any],
        lambdas: Optional[list[float]],
        error: MergeOverflowError,
    ) -> ParameterError:
        """Name the tensor and the setting behind an overflow: lambda (or r), or a dtype."""
        name = group.metadata.name
        dtype = str(error.dtype).removeprefix("torch.")
        if error.cause == "lambda" and error.index is not None and lambdas is not None:
            entry = group.non_base[error.index]
            lam = lambdas[error.index]
            pinned = parameters["lambda"].get(entry.id) is not None
            setting = (
                f"the pinned lambda {lam!r} of {entry.id}"
                if pinned
                else f"lambda = 1 + r * clip(rho) = {lam!r} of {entry.id} (from r = {parameters['r']!r})"
            )
            return ParameterError(
                f"{self.spec.name}: tensor {name}: {setting} times its update does not fit {dtype}; "
                f"lower {'lambda' if pinned else 'r'} (the paper's lambdas are about 1.2)"
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

    def lambdas(self, group: TensorGroup, parameters: dict[str, Any]) -> Optional[list[float]]:
        """lambda_t per fine-tune: pinned, else from its global rho (1 when r = 0); None for RAM."""
        if self.spec.name == "ram":
            return None
        values = []
        for entry in group.non_base:
            pinned = parameters["lambda"].get(entry.id)
            rho = parameters["rho"].get(entry.id)
            if pinned is not None:
                values.append(pinned)
            elif rho is not None:
                values.append(rescale_factor(rho, parameters["r"], parameters["alpha"], parameters["rule"]))
            elif parameters["r"] == 0:
                values.append(1.0)
            else:
                raise MissingStatisticsError(
                    f"ram_plus has no global rho for {entry.id} while merging {group.metadata.name}: "
                    "the whole-model pre-pass did not run on this path. Merge with mergekit-yaml, "
                    "mergekit-multi, mergekit-pytorch or mergekit.merge.run_merge with mergekit-ram "
                    "registered, call the method with every tensor group at once "
                    "(mergekit.merge_methods.merge_state_dicts or mergekit_ram.merge_state_dicts), or "
                    "pin `rho` or `lambda` for each model in the recipe."
                )
        return values

    def _statistics(
        self, parameters: Sequence[dict[str, Any]], counts: Sequence[TensorCounts], source: str
    ) -> RamStatistics:
        """The call's statistics; r, alpha, rule and pins must be one value for the whole call."""
        if self.spec.name == "ram":
            return RamStatistics.build("ram", counts, source=source)  # type: ignore[arg-type]
        settings = {
            name: _one_value(parameters, name, lambda kwargs, name=name: [kwargs[name]])
            for name in ("r", "alpha", "rule")
        }
        pins: dict[str, tuple[Pin, float]] = {}
        for kind in ("lambda", "rho"):
            models = {model for kwargs in parameters for model in kwargs[kind]}
            for model in models:
                value = _one_value(
                    parameters,
                    f"{kind} of {model}",
                    lambda kwargs, kind=kind, model=model: [kwargs[kind][model]] if model in kwargs[kind] else [],
                )
                if value is not None and str(model) not in pins:
                    pins[str(model)] = (kind, value)  # type: ignore[assignment]
        return RamStatistics.build(
            self.spec.name,
            counts,
            r=settings["r"],
            alpha=settings["alpha"],
            rule=settings["rule"],
            pins=pins,
            source=source,  # type: ignore[arg-type]
        )


def _one_value(parameters: Sequence[dict[str, Any]], what: str, values: Callable[[dict[str, Any]], list[Any]]) -> Any:
    """The single value a setting has across a call's groups; lambda_t is global (paper eq. 4)."""
    seen = {value for kwargs in parameters for value in values(kwargs)}
    if len(seen) > 1:
        raise ParameterError(f"ram_plus: {what} must be one value for the whole merge; got {sorted(seen, key=repr)}")
    return next(iter(seen), None)


def _with_rho(group: TensorGroup, parameters: dict[str, Any], statistics: RamStatistics) -> dict[str, Any]:
    """The group's parameters with each unpinned model's global rho."""
    rho = {stats.model: stats.rho for stats in statistics.models}
    values = [
        (
            entry.id,
            parameters["rho"].get(entry.id) if parameters["rho"].get(entry.id) is not None else rho.get(str(entry.id)),
        )
        for entry in group.non_base
    ]
    return {**parameters, "rho": PerInputValues(values)}


def _tensor_counts(group: TensorGroup, parameters: dict[str, Any], histograms: Histograms) -> TensorCounts:
    return TensorCounts(
        name=group.metadata.name or "",
        numel=group.base.tensor.numel(),
        epsilon=parameters["epsilon"],
        models=tuple(str(entry.id) for entry in group.non_base),
        histograms=histograms,
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


RAM = RamMergeMethod("ram")
RAM_PLUS = RamMergeMethod("ram_plus")
METHODS = {method.spec.name: method for method in (RAM, RAM_PLUS)}
