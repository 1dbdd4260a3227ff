"""mergekit's merge tasks read as plain data, and the graph tasks a RAM merge adds.

``planned_tensor`` describes one ``ExecuteMergeMethodTask`` as a ``PlannedTensor`` (what the
checks, the cache and the settings need). ``asking`` copies a merge task with a ``MODE`` for the
method: mergekit's own ``ExecuteMergeMethodTask.execute`` then runs it (its optional-tensor
policy, buffers and checks included) and the method counts, merges, or both. ``take_tensor`` and
``take_counts`` split a "merge+count" result; ``RecordStatistics`` builds the statistics once every
weight is saved, writes ``ram_statistics.json`` and hands them on.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Literal, Mapping, Optional

from pydantic import BaseModel, ConfigDict

from mergekit_ram.files import write_atomically
from mergekit_ram.integration.internals import internal
from mergekit_ram.integration.methods import MODE
from mergekit_ram.planned import PlannedTensor, TensorInput, TensorParameters
from mergekit_ram.settings import Applied, MergeSettings
from mergekit_ram.stats.data import RamStatistics, TensorCounts
from mergekit_ram.stats.render import log_statistics
from mergekit_ram.stats.schema import STATISTICS_FILE, statistics_to_json

Task: Any = internal("mergekit.graph", "Task")
GatherTensors: Any = internal("mergekit.io.tasks", "GatherTensors")
LoaderCache: Any = internal("mergekit.io.tasks", "LoaderCache")
TensorDictWrapper: Any = internal("mergekit.merge_methods.task_adapter", "TensorDictWrapper")
ImmutableMap: Any = internal("mergekit.common", "ImmutableMap")

Mode = Literal["merge", "count", "merge+count"]


def planned_tensor(task: Any) -> PlannedTensor:
    """One merge task as plain data: inputs (file and name per model), parameters, input sub-graph."""
    finetunes = tuple(model for model in task.model_order if model != task.base_model)
    return PlannedTensor(
        name=task.output_weight.name,
        optional=task.output_weight.optional,
        vocabulary_axis=task.output_weight.vocabulary_axis,
        reshaped=not isinstance(task.gather_tensors, (GatherTensors, TensorDictWrapper)),
        base=str(task.base_model),
        finetunes=tuple(str(model) for model in finetunes),
        inputs=tuple(_task_inputs(task)),
        parameters=TensorParameters.of(
            task.method_name,
            task.output_weight.name,
            dict(task.parameters.items()),
            {str(model): dict(task.input_parameters[model].items()) for model in finetunes},
        ),
        graph=describe(task.gather_tensors),
    )


def _task_inputs(task: Any) -> Iterator[TensorInput]:
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


def asking(task: Any, mode: Mode, applied: Mapping[str, Applied]) -> Any:
    """The merge task with ``MODE`` for the method, and each fine-tune's lambda with the rho it came
    from (None when pinned) where ``applied`` gives them."""

    def own(model: Any, values: Any) -> Any:
        if model == task.base_model or str(model) not in applied:
            return values
        return ImmutableMap(data={**values, "lambda": applied[str(model)].lambda_, "rho": applied[str(model)].rho})

    return task.model_copy(
        update={
            "parameters": ImmutableMap(data={**task.parameters, MODE: mode}),
            "input_parameters": ImmutableMap(data={m: own(m, v) for m, v in task.input_parameters.items()}),
        }
    )


class _Part(Task[Any]):
    """One part of a "merge+count" result (mergekit's own execute returns a bare tensor, or None, where it
    passes an optional tensor through or copies a buffer: then there are no counts)."""

    source: Any
    part: int

    def arguments(self) -> dict[str, Any]:
        return {"value": self.source}

    def group_label(self) -> Optional[str]:
        return self.source.group_label()

    def execute(self, value: Any) -> Any:
        if isinstance(value, tuple):
            return value[self.part]
        return value if self.part == 0 else None


def take_tensor(task: Any) -> Any:
    return _Part(source=task, part=0)


def take_counts(task: Any) -> Any:
    return _Part(source=task, part=1)


@dataclass(frozen=True, eq=False)
class Computed:
    """Statistics the pre-pass computed, held by identity (a task's fields must be hashable)."""

    statistics: RamStatistics


class RecordStatistics(Task[RamStatistics]):
    """The merge's statistics once every weight is saved: from the pre-pass (``computed``) or from the
    merge's own counts; written to ``ram_statistics.json`` in ``out_path`` and handed to ``deliver``."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    out_path: Optional[str]
    settings: MergeSettings
    deliver: Callable[[RamStatistics], None]
    computed: Optional[Computed] = None
    counts: tuple[Any, ...] = ()
    after: Optional[Any] = None

    def arguments(self) -> dict[str, Any]:
        arguments: dict[str, Any] = {f"counts_{index}": task for index, task in enumerate(self.counts)}
        if self.after is not None:
            arguments["after"] = self.after
        return arguments

    def main_thread_only(self) -> bool:
        return True

    def priority(self) -> int:
        return -10000

    def execute(self, **kwargs: Any) -> RamStatistics:
        statistics = self.computed.statistics if self.computed is not None else None
        if statistics is None:
            counted = [kwargs[f"counts_{index}"] for index in range(len(self.counts))]
            statistics = self.settings.statistics([c for c in counted if isinstance(c, TensorCounts)], "merge")
            log_statistics(statistics)
        if self.out_path is not None:
            write_atomically(os.path.join(self.out_path, STATISTICS_FILE), statistics_to_json(statistics))
        self.deliver(statistics)
        return statistics
