"""The global pre-pass and the statistics of a planned merge.

Driven by the planner's own merge tasks: each ``ExecuteMergeMethodTask`` is wrapped in a
task that runs its input sub-graph through the kernel in counting mode, on a separate
executor, before the merge graph runs. Peak memory stays one tensor group; every input
is read twice. When no lambda depends on the counts (``ram``, ``r = 0``, every model
pinned), the counts are taken during the merge itself instead.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Sequence

import torch
from mergekit.common import ImmutableMap, ModelReference
from mergekit.graph import Executor, Task
from mergekit.io.tasks import FinalizeModel, ReturnTensor, SaveTensor
from mergekit.merge_methods.task_adapter import ExecuteMergeMethodTask
from mergekit.options import MergeOptions
from pydantic import BaseModel

from mergekit_ram import cache, staging
from mergekit_ram.checks import check_tensors
from mergekit_ram.methods import METHODS, count_request
from mergekit_ram.parameters import ALPHA, RULE, ParameterError, R
from mergekit_ram.rescaling import Rescaling
from mergekit_ram.stats import (
    STATISTICS_FILE,
    Pin,
    RamStatistics,
    TensorCounts,
    build_statistics,
    log_statistics,
    statistics_from_dict,
    statistics_to_json,
)

LOG = logging.getLogger(__name__)


class PrePassCount(Task[Optional[TensorCounts]]):
    """One merge task's inputs through the kernel in counting mode."""

    merge_task: ExecuteMergeMethodTask

    def arguments(self) -> dict[str, Task]:
        return self.merge_task.arguments()

    def group_label(self) -> Optional[str]:
        return self.merge_task.group_label()

    def uses_accelerator(self) -> bool:
        return self.merge_task.uses_accelerator()

    def execute(self, **kwargs: Any) -> Optional[TensorCounts]:
        with count_request(merge=False) as request:
            self.merge_task.execute(**kwargs)
        return request.counts


class MergeAndCount(Task[tuple]):
    """A merge task that also returns the counts its kernel took."""

    merge_task: ExecuteMergeMethodTask

    def arguments(self) -> dict[str, Task]:
        return self.merge_task.arguments()

    def group_label(self) -> Optional[str]:
        return self.merge_task.group_label()

    def uses_accelerator(self) -> bool:
        return self.merge_task.uses_accelerator()

    def execute(self, **kwargs: Any) -> tuple[Optional[torch.Tensor], Optional[TensorCounts]]:
        with count_request(merge=True) as request:
            merged = self.merge_task.execute(**kwargs)
        return merged, request.counts


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


class StatisticsContext(BaseModel, frozen=True):
    """What turns counts into statistics, fixed at plan time."""

    method: str
    r: float = 0.0
    alpha: float = 0.0
    rule: str = RULE.default
    pins: tuple[tuple[str, Pin, float], ...] = ()
    checkpoint_dtypes: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def build(self, tensors: Iterable[TensorCounts], source: str) -> RamStatistics:
        return build_statistics(
            self.method,
            tensors,
            rescaling=None if self.method == "ram" else Rescaling(self.r, self.alpha, self.rule),
            pins={model: (kind, value) for model, kind, value in self.pins},
            source=source,  # type: ignore[arg-type]
            checkpoint_dtypes=dict(self.checkpoint_dtypes),
        )


class WriteRamStatistics(Task[RamStatistics]):
    """Writes ``ram_statistics.json`` once every weight is saved."""

    out_path: Optional[str]
    context: StatisticsContext
    statistics_json: Optional[str] = None
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
        if self.statistics_json is not None:
            statistics = statistics_from_dict(json.loads(self.statistics_json))
        else:
            tensors = [kwargs[f"counts_{index}"] for index in range(len(self.counts))]
            statistics = self.context.build([t for t in tensors if t is not None], source="merge")
            log_statistics(statistics)
        if self.out_path is not None:
            write_statistics(statistics, self.out_path)
        return statistics


def write_statistics(statistics: RamStatistics, out_path: str) -> None:
    """Write the JSON file atomically, so a reader never sees half of it."""
    staging.write_atomically(os.path.join(out_path, STATISTICS_FILE), statistics_to_json(statistics))


@dataclass(frozen=True)
class RamPlan:
    """Replacement merge tasks, and the statistics when the pre-pass computed them."""

    tasks: list[Task]
    context: StatisticsContext
    statistics: Optional[RamStatistics]
    counts: tuple[TakeCounts, ...]


def checked_context(merge_tasks: Sequence[ExecuteMergeMethodTask]) -> StatisticsContext:
    """Check every input's header, then fix what turns counts into statistics."""
    method = merge_tasks[0].method_name if merge_tasks else "ram"
    facts = check_tensors(merge_tasks)
    return _statistics_context(method, merge_tasks).model_copy(
        update={"checkpoint_dtypes": tuple((model, tuple(sorted(d))) for model, d in sorted(facts.dtypes.items()))}
    )


def plan_ram(merge_tasks: Sequence[ExecuteMergeMethodTask], options: MergeOptions) -> RamPlan:
    """Check every input, compute global statistics if lambdas need them, give each task its rho."""
    context = checked_context(merge_tasks)
    method = context.method
    pinned = {model for model, _, _ in context.pins}
    finetunes = {model for task in merge_tasks for model in _finetunes(task)}
    needs_prepass = method == "ram_plus" and context.r > 0 and any(str(m) not in pinned for m in finetunes)
    if method == "ram":
        LOG.info("merge_method 'ram' is mergekit-ram's float32 RAM (it replaces mergekit's built-in 'ram')")
    if not needs_prepass:
        wrapped = [MergeAndCount(merge_task=task) for task in merge_tasks]
        return RamPlan(
            tasks=[TakeTensor(source=task) for task in wrapped],
            context=context,
            statistics=None,
            counts=tuple(TakeCounts(source=task) for task in wrapped),
        )

    statistics = context.build(counted_prepass(merge_tasks, options), source="pre-pass")
    log_statistics(statistics)
    rho = {stats.model: stats.rho for stats in statistics.models}
    tasks: list[Task] = [
        task.model_copy(
            update={
                "input_parameters": ImmutableMap(
                    data={
                        model: ImmutableMap(data={**params, "rho": rho[str(model)]})
                        if model in _finetunes(task) and str(model) not in pinned
                        else params
                        for model, params in task.input_parameters.items()
                    }
                )
            }
        )
        for task in merge_tasks
    ]
    return RamPlan(tasks=tasks, context=context, statistics=statistics, counts=())


def counted_prepass(merge_tasks: Sequence[ExecuteMergeMethodTask], options: MergeOptions) -> list[TensorCounts]:
    """The pre-pass counts, from the cache when nothing they depend on changed."""
    key = cache.cache_key(merge_tasks) if cache.mode() != "off" else None
    counts = cache.load(key, merge_tasks) if key is not None else None
    if counts is None:
        started = time.perf_counter()
        LOG.info("ram_plus pre-pass: counting changed parameters over %d tensors", len(merge_tasks))
        counts = run_prepass(merge_tasks, options)
        LOG.info("ram_plus pre-pass done in %.1f s", time.perf_counter() - started)
        if key is not None:
            cache.store(key, counts)
    return [value for value in counts if value is not None]


def run_prepass(merge_tasks: Sequence[ExecuteMergeMethodTask], options: MergeOptions) -> list[Optional[TensorCounts]]:
    """One streaming pass over the merge's own inputs; counts per merge task (None: no counts)."""
    count_tasks = [PrePassCount(merge_task=task) for task in merge_tasks]
    order = {task: index for index, task in enumerate(count_tasks)}
    if options.multi_gpu:
        from mergekit.multigpu_executor import MultiGPUExecutor

        executor: Any = MultiGPUExecutor(targets=count_tasks, storage_device=None if options.low_cpu_memory else "cpu")
        results = executor.run(quiet=options.quiet)
    else:
        executor = Executor(
            count_tasks,
            math_device=options.device,
            storage_device=options.device if options.low_cpu_memory else "cpu",
        )
        results = executor.run(quiet=options.quiet, desc="RAM+ pre-pass")
    counts: list[Optional[TensorCounts]] = [None] * len(count_tasks)
    for task, value in results:
        counts[order[task]] = value
    return counts


def attach_ram_plan(targets: list[Task], options: MergeOptions, out_path: Optional[str]) -> list[Task]:
    """Rewrite planned targets (SaveTensor or ReturnTensor) for a RAM merge.

    On disk, ``ram_statistics.json`` is written into ``out_path`` after the weights. Under
    ``run_merge`` and ``mergekit-pytorch`` that is the staging folder of an output
    transaction (see ``staging``), which publishes everything once the merge is complete.
    """
    outputs = [task for task in targets if isinstance(task, (SaveTensor, ReturnTensor))]
    # The kernel writes the output dtype itself (one rounding); the save's cast is then a no-op.
    merge_tasks = [
        task.tensor_task.model_copy(update={"out_dtype": task.dtype}) if task.dtype else task.tensor_task
        for task in outputs
    ]
    plan = plan_ram(merge_tasks, options)
    replaced = {id(old): old.model_copy(update={"tensor_task": new}) for old, new in zip(outputs, plan.tasks)}
    rewritten: list[Task] = []
    finalize: Optional[FinalizeModel] = None
    for task in targets:
        if isinstance(task, FinalizeModel):
            task = finalize = task.model_copy(
                update={"tensor_save_tasks": tuple(replaced.get(id(t), t) for t in task.tensor_save_tasks)}
            )
        rewritten.append(replaced.get(id(task), task))
    rewritten.append(
        WriteRamStatistics(
            out_path=out_path,
            context=plan.context,
            statistics_json=statistics_to_json(plan.statistics) if plan.statistics is not None else None,
            counts=plan.counts,
            after=finalize,
        )
    )
    return rewritten


def _finetunes(task: ExecuteMergeMethodTask) -> list[ModelReference]:
    return [model for model in task.model_order if model != task.base_model]


def _statistics_context(method: str, merge_tasks: Sequence[ExecuteMergeMethodTask]) -> StatisticsContext:
    """r, alpha and rule must be one value per merge; pins one value per model."""
    if method not in METHODS:
        raise ValueError(f"not a mergekit-ram method: {method!r}")
    if method == "ram":
        return StatisticsContext(method=method)
    settings: dict[str, dict[Any, str]] = {"r": {}, "alpha": {}, "rule": {}}
    pins: dict[str, dict[tuple[Pin, Any], str]] = {}
    for task in merge_tasks:
        tensor = task.output_weight.name
        for name, seen in settings.items():
            seen.setdefault(task.parameters[name], tensor)
        for model in _finetunes(task):
            params = task.input_parameters[model]
            pin: tuple[Pin, Any] = (
                ("lambda", params["lambda"]) if params.get("lambda") is not None else ("rho", params.get("rho"))
            )
            pins.setdefault(str(model), {}).setdefault(pin, tensor)
    for name, seen in settings.items():
        if len(seen) > 1:
            (first, first_tensor), (second, second_tensor) = list(seen.items())[:2]
            raise ParameterError(
                f"ram_plus: parameter {name!r} must be one value for the whole merge (lambda_t is global, "
                f"paper eq. 4); got {first!r} for {first_tensor} and {second!r} for {second_tensor}"
            )
    resolved_pins = []
    for model, seen in pins.items():
        if len(seen) > 1:
            (first, first_tensor), (second, second_tensor) = list(seen.items())[:2]
            raise ParameterError(
                f"ram_plus: the pinned {first[0]} of {model} must be one value for the whole merge; "
                f"got {first[1]!r} for {first_tensor} and {second[0]}={second[1]!r} for {second_tensor}"
            )
        ((kind, value),) = seen
        if value is not None:
            resolved_pins.append((model, kind, value))
    return StatisticsContext(
        method=method,
        r=next(iter(settings["r"]), R.default),
        alpha=next(iter(settings["alpha"]), ALPHA.default),
        rule=next(iter(settings["rule"]), RULE.default),
        pins=tuple(resolved_pins),
    )
