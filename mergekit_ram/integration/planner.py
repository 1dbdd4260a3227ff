"""The planner's side of a RAM merge: checks, the global pre-pass, lambdas injected, statistics.

``MergePlanner.plan_to_disk`` / ``plan_in_memory`` and ``mergekit-pytorch``'s ``plan_flat_merge``
are wrapped: a RAM recipe is checked (once per merge: inside ``run_merge`` its wrapper has
checked it and passes its header cache along in ``CheckedOptions``), then the planned targets
are rewritten by ``attach_ram_plan``:

- every merge task is described as plain data, and its inputs' headers are checked;
- when some lambda depends on a global rho, the pre-pass runs the merge tasks' own inputs
  through the kernel in counting mode (one tensor group at a time, on a separate executor, or
  from the cache), and the statistics give each model's lambda once;
- each merge task gets those lambdas in its parameters; the statistics are written to
  ``ram_statistics.json`` after the weights (counted during the merge itself when no lambda
  depends on them).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, Optional, Sequence

from mergekit.graph import Executor, Task
from mergekit.io.tasks import FinalizeModel, ReturnTensor, SaveTensor
from mergekit.merge_methods.task_adapter import ExecuteMergeMethodTask
from mergekit.options import MergeOptions
from pydantic import PrivateAttr

from mergekit_ram import cache
from mergekit_ram.checks import HeaderCache, check_tensors
from mergekit_ram.integration.recipes import check_config
from mergekit_ram.integration.registry import is_ours
from mergekit_ram.integration.tasks import (
    Computed,
    CountTensor,
    MergeAndCount,
    TakeCounts,
    TakeTensor,
    WriteRamStatistics,
    planned_tensor,
    with_lambdas,
)
from mergekit_ram.integration.versions import require, wrap
from mergekit_ram.planned import PlannedTensor
from mergekit_ram.settings import MergeSettings, merge_settings
from mergekit_ram.stats.data import RamStatistics, TensorCounts
from mergekit_ram.stats.render import log_statistics

LOG = logging.getLogger(__name__)


@dataclass(frozen=True)
class PlannedMerge:
    """A RAM merge's merge tasks, the same as plain data, and the headers its checks read."""

    merge_tasks: list[ExecuteMergeMethodTask]
    tensors: list[PlannedTensor]
    headers: HeaderCache
    modules: dict[str, str]  # output tensor -> mergekit module, in a merge of several modules

    @classmethod
    def of(
        cls, merge_tasks: Sequence[ExecuteMergeMethodTask], headers: HeaderCache, modules: dict[str, str]
    ) -> PlannedMerge:
        return cls(list(merge_tasks), [planned_tensor(task) for task in merge_tasks], headers, modules)

    def settings(self, method: str) -> MergeSettings:
        """The merge's settings, once the inputs' headers are checked."""
        dtypes = check_tensors(self.tensors, self.headers).dtypes
        return merge_settings(method, [tensor.parameters for tensor in self.tensors], dtypes, self.modules)

    def finetunes(self) -> list[str]:
        return list(dict.fromkeys(model for tensor in self.tensors for model in tensor.finetunes))


class CheckedOptions(MergeOptions):
    """mergekit's options for a recipe that ``run_merge``'s wrapper has checked: the planner
    skips the recipe checks and reuses the headers they read."""

    _headers: Optional[HeaderCache] = PrivateAttr(default=None)


def checked_options(options: MergeOptions, headers: HeaderCache) -> CheckedOptions:
    checked = CheckedOptions.model_validate(options.model_dump())
    checked._headers = headers
    return checked


def _checked(method: str, config: Any, options: Any) -> HeaderCache:
    """The header cache of a recipe already checked in this merge, or of a check run now."""
    headers = options._headers if isinstance(options, CheckedOptions) else None
    if headers is None:
        headers = HeaderCache()
        check_config(method, config, headers)
    return headers


def patch_planner(plan: ModuleType) -> None:
    """Check RAM recipes before planning; add the pre-pass, lambdas and statistics after."""
    planner = require(plan, "MergePlanner")

    def make(original: Callable[..., Any], to_disk: bool) -> Callable[..., Any]:
        def planned(self: Any, *args: Any, **kwargs: Any) -> Any:
            method = self.config.merge_method
            if not is_ours(method):
                return original(self, *args, **kwargs)
            headers = _checked(method, self.config, self.options)
            out_path = (args[0] if args else kwargs["out_path"]) if to_disk else None
            targets = original(self, *args, **kwargs)
            return attach_ram_plan(targets, self.options, out_path, headers, tensor_modules(self))

        return planned

    wrap(planner, "plan_to_disk", lambda original: make(original, True))
    wrap(planner, "plan_in_memory", lambda original: make(original, False))


def patch_flat_plan(raw: ModuleType) -> None:
    """``mergekit-pytorch`` plans its own flat merge: the same checks, pre-pass and statistics."""

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def plan_flat_merge(
            config: Any, out_path: str, tensor_union: bool, tensor_intersection: bool, options: Any
        ) -> Any:
            if not is_ours(config.merge_method):
                return original(config, out_path, tensor_union, tensor_intersection, options)
            headers = _checked(config.merge_method, config, options)
            targets = original(config, out_path, tensor_union, tensor_intersection, options)
            return attach_ram_plan(targets, options, out_path, headers)

        return plan_flat_merge

    wrap(raw, "plan_flat_merge", make)


def tensor_modules(planner: Any) -> dict[str, str]:
    """Each output tensor's module in a merge of several (a ``modules:`` recipe; mergekit's text
    decoder, vision tower, ...), from the output model's architecture; empty for one module."""
    from mergekit.architecture import ConfiguredModuleArchitecture

    if len(planner.config.modules or {}) < 2:
        return {}
    found: dict[str, str] = {}
    for module in planner.config.modules:
        definition = planner.arch_info.modules[module]
        architecture = ConfiguredModuleArchitecture(
            info=definition.architecture, config=planner.out_model_config, weight_prefix=definition.weight_prefix
        )
        found.update((weight.name, module) for weight in architecture.all_weights())
    return found


def attach_ram_plan(
    targets: list[Task],
    options: MergeOptions,
    out_path: Optional[str],
    headers: HeaderCache,
    modules: Optional[dict[str, str]] = None,
) -> list[Task]:
    """Rewrite planned targets (SaveTensor or ReturnTensor) for a RAM merge.

    On disk, ``ram_statistics.json`` is written into ``out_path`` after the weights. Under
    ``run_merge`` and ``mergekit-pytorch`` that is the staging folder of an output
    transaction (``mergekit_ram.staging``), which publishes everything once the merge is complete.
    """
    outputs = [task for task in targets if isinstance(task, (SaveTensor, ReturnTensor))]
    # The kernel writes the output dtype itself (one rounding); the save's cast is then a no-op.
    merge_tasks = [
        task.tensor_task.model_copy(update={"out_dtype": task.dtype}) if task.dtype else task.tensor_task
        for task in outputs
    ]
    plan = PlannedMerge.of(merge_tasks, headers, modules or {})
    settings = plan.settings(merge_tasks[0].method_name if merge_tasks else "ram")
    finetunes = plan.finetunes()
    if settings.method == "ram":
        LOG.info("merge_method 'ram' is mergekit-ram's float32 RAM (it replaces mergekit's built-in 'ram')")
    statistics: Optional[RamStatistics] = None
    counts: tuple[TakeCounts, ...] = ()
    if settings.needs_counts(finetunes):
        statistics = settings.statistics(counted_prepass(plan, options), source="pre-pass")
        log_statistics(statistics)
    applied = settings.applied(finetunes, statistics)
    tasks: list[Task] = [with_lambdas(task, applied) for task in merge_tasks]
    if statistics is None:
        merged = [MergeAndCount(merge_task=task) for task in tasks]
        tasks = [TakeTensor(source=task) for task in merged]
        counts = tuple(TakeCounts(source=task) for task in merged)

    replaced = {id(old): old.model_copy(update={"tensor_task": new}) for old, new in zip(outputs, tasks)}
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
            settings=settings,
            computed=Computed(statistics) if statistics is not None else None,
            counts=counts,
            after=finalize,
        )
    )
    return rewritten


def counted_prepass(plan: PlannedMerge, options: MergeOptions) -> list[TensorCounts]:
    """The pre-pass counts, from the cache when nothing they depend on changed."""
    key = cache.cache_key(plan.tensors) if cache.mode() != "off" else None
    counts = cache.load(key, plan.tensors, plan.headers) if key is not None else None
    if counts is None:
        started = time.perf_counter()
        LOG.info("ram_plus pre-pass: counting changed parameters over %d tensors", len(plan.merge_tasks))
        counts = run_prepass(plan.merge_tasks, options)
        LOG.info("ram_plus pre-pass done in %.1f s", time.perf_counter() - started)
        if key is not None:
            cache.store(key, counts)
    return [value for value in counts if value is not None]


def run_prepass(merge_tasks: Sequence[ExecuteMergeMethodTask], options: MergeOptions) -> list[Optional[TensorCounts]]:
    """One streaming pass over the merge's own inputs; counts per merge task (None: no counts)."""
    count_tasks = [CountTensor(merge_task=task) for task in merge_tasks]
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


def plan_merge(config: Any, options: MergeOptions) -> PlannedMerge:
    """Plan a recipe exactly as ``run_merge`` would, without running it (the probe; the methods
    must be registered)."""
    import mergekit.merge
    from mergekit.architecture import get_architecture_info
    from mergekit.io.tasks import LoaderCache
    from mergekit.plan import MergePlanner

    headers = HeaderCache()
    check_config(config.merge_method, config, headers)
    arch_info = get_architecture_info(config, options)
    loaders = LoaderCache()
    loaders.setup(options=options)
    for model in config.referenced_models():
        loaders.get(model)
    out_config = require(mergekit.merge, "_model_out_config")(
        config, arch_info, trust_remote_code=options.trust_remote_code
    )
    planner = MergePlanner(config, arch_info, options=options, out_model_config=out_config)
    # plan_in_memory would do, but mergekit 0.1.5's ReturnTensor refuses its own merge tasks.
    require(planner, "_plan")()
    return PlannedMerge.of([task for _, task in require(planner, "_tensors")], headers, tensor_modules(planner))


def probe_statistics(config: Any, options: MergeOptions) -> RamStatistics:
    """Only the pre-pass of a ``ram`` / ``ram_plus`` recipe (the probe): its statistics."""
    plan = plan_merge(config, options)
    return plan.settings(config.merge_method).statistics(counted_prepass(plan, options), source="pre-pass")
