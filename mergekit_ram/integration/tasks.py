"""mergekit graph tasks for RAM merges, and mergekit's merge tasks read as plain data.

``planned_tensor`` describes one ``ExecuteMergeMethodTask`` as a ``PlannedTensor`` (what
the checks, the cache and the settings need). ``CountTensor`` (the pre-pass) and
``MergeAndCount`` (a merge that also counts) hand the method the tensor group that
``ExecuteMergeMethodTask.execute`` would build; ``WriteRamStatistics`` writes
``ram_statistics.json`` once every weight is saved.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Optional, TypeVar

import torch
from mergekit.common import ImmutableMap, ModelReference, dtype_from_name
from mergekit.graph import Task
from mergekit.io.tasks import GatherTensors, LoaderCache
from mergekit.merge_methods.base import ParameterScope, PerInputValues, TensorEntry, TensorGroup, TensorMetadata
from mergekit.merge_methods.dtype import promoted_dtype
from mergekit.merge_methods.task_adapter import ExecuteMergeMethodTask, TensorDictWrapper
from pydantic import BaseModel, ConfigDict

from mergekit_ram.files import write_atomically
from mergekit_ram.integration.methods import METHODS
from mergekit_ram.parameters import parameter_scopes
from mergekit_ram.planned import PlannedTensor, TensorInput, TensorParameters
from mergekit_ram.settings import Applied, MergeSettings
from mergekit_ram.stats.data import RamStatistics, TensorCounts
from mergekit_ram.stats.render import log_statistics
from mergekit_ram.stats.schema import STATISTICS_FILE, statistics_to_json

ValueT = TypeVar("ValueT")


def planned_tensor(task: ExecuteMergeMethodTask) -> PlannedTensor:
    """One merge task as plain data: inputs (file and name per model), parameters, input sub-graph."""
    finetunes = tuple(model for model in task.model_order if model != task.base_model)
    shared, per_model = parameter_scopes(task.method_name)
    return PlannedTensor(
        name=task.output_weight.name,
        optional=task.output_weight.optional,
        vocabulary_axis=task.output_weight.vocabulary_axis,
        reshaped=not isinstance(task.gather_tensors, (GatherTensors, TensorDictWrapper)),
        base=str(task.base_model),
        finetunes=tuple(str(model) for model in finetunes),
        inputs=tuple(_task_inputs(task)),
        parameters=TensorParameters(
            name=task.output_weight.name,
            shared=tuple((name, task.parameters[name]) for name in shared if name in task.parameters),
            per_model=tuple(
                (str(model), tuple((name, task.input_parameters[model].get(name)) for name in per_model))
                for model in finetunes
            ),
        ),
        graph=describe(task.gather_tensors),
    )


def _task_inputs(task: ExecuteMergeMethodTask) -> Iterator[TensorInput]:
    """Each input model's file holding the tensor (None if it has none) and the name in that file."""
    source = task.gather_tensors
    if isinstance(source, TensorDictWrapper):
        for model, load in source.tensors.items():
            yield TensorInput(str(model), load.model, load.tensor_name)
        return
    gather = source if isinstance(source, GatherTensors) else source.gather_tensors
    for model, weight in gather.weight_info.items():
        index = LoaderCache().get(model).index
        names = [weight.name, *(weight.aliases or ()), *(weight.tied_names or ())]
        name = next((n for n in names if n in index.tensor_paths), None)
        if name is None:
            yield TensorInput(str(model), None, weight.name)
        else:
            yield TensorInput(str(model), os.path.join(index.base_path, index.tensor_paths[name]), name)


def describe(value: Any) -> str:
    """A canonical text for a planned task graph (pydantic models, mergekit's maps, scalars)."""
    if isinstance(value, BaseModel):
        fields = ", ".join(f"{name}={describe(getattr(value, name))}" for name in type(value).model_fields)
        return f"{type(value).__name__}({fields})"
    if isinstance(value, (Mapping, ImmutableMap)):
        items = sorted((describe(key), describe(value[key])) for key in value)
        return "{" + ", ".join(f"{key}: {item}" for key, item in items) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(describe(item) for item in value) + "]"
    return repr(value)


def with_lambdas(task: ExecuteMergeMethodTask, applied: Mapping[str, Applied]) -> ExecuteMergeMethodTask:
    """The merge task with each fine-tune's lambda, and the rho it came from (None when pinned)."""
    if not applied:
        return task
    return task.model_copy(
        update={
            "input_parameters": ImmutableMap(
                data={
                    model: ImmutableMap(
                        data={**params, "lambda": applied[str(model)].lambda_, "rho": applied[str(model)].rho}
                    )
                    if model != task.base_model
                    else params
                    for model, params in task.input_parameters.items()
                }
            )
        }
    )


@dataclass(frozen=True)
class _MethodCall:
    """What ``ExecuteMergeMethodTask.execute`` hands the method for one tensor."""

    group: TensorGroup
    parameters: dict[str, Any]
    dtype: Optional[torch.dtype]
    out_dtype: Optional[torch.dtype]


def _method_call(task: ExecuteMergeMethodTask, tensors: Mapping[ModelReference, torch.Tensor]) -> Optional[_MethodCall]:
    """The group and parameters mergekit would give the method, or None where it would not call it
    (an optional tensor some model lacks: passed through or skipped; a non-floating buffer: copied)."""
    entries = tuple(
        TensorEntry(id=model, tensor=tensor, is_base=model == task.base_model)
        for model in task.model_order
        if (tensor := tensors.get(model)) is not None
    )
    if len(entries) < len(task.model_order) or not all(entry.tensor.is_floating_point() for entry in entries):
        return None
    group = TensorGroup(entries=entries, metadata=TensorMetadata.from_weight_info(task.output_weight))
    method = METHODS[task.method_name]
    method.validate_inputs([entry.id for entry in entries], task.base_model, group_name=task.output_weight.name)
    group.validate_tensors()
    parameters = dict(task.parameters.items())
    for spec in method.spec.input_parameters:
        inputs = entries if spec.scope == ParameterScope.INPUT else group.non_base
        parameters[spec.name] = PerInputValues(
            [(entry.id, task.input_parameters[entry.id][spec.name]) for entry in inputs]
        )
    dtype = dtype_from_name(task.dtype) or promoted_dtype(group)
    return _MethodCall(group, parameters, dtype, dtype_from_name(task.out_dtype))


class _OnMergeTaskInputs(Task[ValueT]):
    """A task on a merge task's own inputs: same arguments, group and device as that task."""

    merge_task: ExecuteMergeMethodTask

    def arguments(self) -> dict[str, Task]:
        return self.merge_task.arguments()

    def group_label(self) -> Optional[str]:
        return self.merge_task.group_label()

    def uses_accelerator(self) -> bool:
        return self.merge_task.uses_accelerator()


class CountTensor(_OnMergeTaskInputs[Optional[TensorCounts]]):
    """The pre-pass for one merge task: its inputs through the kernel in counting mode."""

    def execute(self, tensors: Mapping[ModelReference, torch.Tensor], **_kwargs: Any) -> Optional[TensorCounts]:
        call = _method_call(self.merge_task, tensors)
        if call is None:
            return None
        return METHODS[self.merge_task.method_name].count(call.group, call.parameters, call.dtype)


class MergeAndCount(_OnMergeTaskInputs[tuple]):
    """A merge task that also returns the counts its kernel took (no counts where mergekit copies)."""

    def execute(
        self, tensors: Mapping[ModelReference, torch.Tensor], **kwargs: Any
    ) -> tuple[Optional[torch.Tensor], Optional[TensorCounts]]:
        call = _method_call(self.merge_task, tensors)
        if call is None:
            return self.merge_task.execute(tensors=tensors, **kwargs), None
        method = METHODS[self.merge_task.method_name]
        return method.merge(call.group, call.parameters, call.dtype, call.out_dtype, count=True)


class TakeTensor(Task[Optional[torch.Tensor]]):
    source: MergeAndCount

    def arguments(self) -> dict[str, Task]:
        return {"value": self.source}

    def group_label(self) -> Optional[str]:
        return self.source.group_label()

    def execute(self, value: tuple) -> Optional[torch.Tensor]:
        return value[0]


class TakeCounts(Task[Optional[TensorCounts]]):
    source: MergeAndCount

    def arguments(self) -> dict[str, Task]:
        return {"value": self.source}

    def group_label(self) -> Optional[str]:
        return self.source.group_label()

    def execute(self, value: tuple) -> Optional[TensorCounts]:
        return value[1]


@dataclass(frozen=True, eq=False)
class Computed:
    """Statistics the pre-pass computed, held by identity (a task field must be hashable)."""

    statistics: RamStatistics


class WriteRamStatistics(Task[RamStatistics]):
    """Writes ``ram_statistics.json`` into ``out_path`` once every weight is saved.

    The statistics come from the pre-pass (``computed``) or from the merge's own counts.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    out_path: Optional[str]
    settings: MergeSettings
    computed: Optional[Computed] = None
    counts: tuple[TakeCounts, ...] = ()
    after: Optional[Task] = None

    def arguments(self) -> dict[str, Task]:
        arguments: dict[str, Task] = {f"counts_{index}": task for index, task in enumerate(self.counts)}
        if self.after is not None:
            arguments["after"] = self.after
        return arguments

    def main_thread_only(self) -> bool:
        return True

    def priority(self) -> int:
        return -10000

    def execute(self, **kwargs: Any) -> RamStatistics:
        if self.computed is not None:
            statistics = self.computed.statistics
        else:
            tensors = [kwargs[f"counts_{index}"] for index in range(len(self.counts))]
            statistics = self.settings.statistics([t for t in tensors if t is not None], source="merge")
            log_statistics(statistics)
        if self.out_path is not None:
            write_atomically(os.path.join(self.out_path, STATISTICS_FILE), statistics_to_json(statistics))
        return statistics
