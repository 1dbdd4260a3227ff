"""The planner's side of a RAM merge: checks, the global pre-pass, lambdas injected, statistics.

``MergePlanner.plan_to_disk`` / ``plan_in_memory`` are wrapped: the planned targets of a RAM
recipe are rewritten by ``attach_ram_plan``:

- every merge task is described as plain data, and its inputs' headers are checked;
- when some lambda depends on a global rho, the pre-pass runs the merge tasks, asked to count,
  on a separate executor (one tensor group at a time), or takes the counts from the cache, and
  the statistics give each model's lambda once;
- each merge task gets those lambdas, and a ``RecordStatistics`` task runs after the weights
  (counting during the merge itself when no lambda depends on the counts).

What one merge hands through mergekit travels in a ``RamRun``: the headers its checks read and the
cache settings, in; the statistics, out. ``run_merge``'s wrapper passes it in the options
(``RamOptions``, mergekit's only argument into its planner); a planner called any other way
makes its own.
"""

from __future__ import annotations

import inspect
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from pydantic import PrivateAttr

from mergekit_ram.cache import CacheSettings, opened
from mergekit_ram.checks import HeaderCache, check_tensors
from mergekit_ram.integration.internals import internal, wrap
from mergekit_ram.integration.recipes import check_config
from mergekit_ram.integration.registry import is_ours
from mergekit_ram.integration.tasks import (
    Computed,
    Mode,
    RecordStatistics,
    asking,
    planned_tensor,
    take_counts,
    take_tensor,
)
from mergekit_ram.planned import PlannedTensor
from mergekit_ram.settings import MergeSettings, merge_settings
from mergekit_ram.stats.data import RamStatistics, TensorCounts
from mergekit_ram.stats.render import log_statistics

LOG = logging.getLogger(__name__)

MergeOptions: Any = internal("mergekit.options", "MergeOptions")
MergePlanner: Any = internal("mergekit.plan", "MergePlanner")
Executor: Any = internal("mergekit.graph", "Executor")
SaveTensor: Any = internal("mergekit.io.tasks", "SaveTensor")
ReturnTensor: Any = internal("mergekit.io.tasks", "ReturnTensor")
FinalizeModel: Any = internal("mergekit.io.tasks", "FinalizeModel")
ConfiguredModuleArchitecture: Any = internal("mergekit.architecture", "ConfiguredModuleArchitecture")


@dataclass(eq=False)
class RamRun:
    """One RAM merge's values that travel through mergekit: the headers its checks read and the
    cache settings, in; the statistics, out (``receive``)."""

    headers: HeaderCache
    cache: CacheSettings
    statistics: Optional[RamStatistics] = None

    @classmethod
    def checked(cls, config: Any, options: Any, source: Optional[str] = None) -> RamRun:
        """A run for ``config``, checked before anything is read (``source``: the recipe's YAML)."""
        run = cls(HeaderCache(), CacheSettings.from_environment())
        check_config(config.merge_method, config, run.headers, source, allow_crimes=options.allow_crimes)
        return run

    def receive(self, statistics: RamStatistics) -> None:
        self.statistics = statistics


class RamOptions(MergeOptions):
    """mergekit's options, with the ``RamRun`` of the merge they are for."""

    _run: Optional[RamRun] = PrivateAttr(default=None)


def with_run(options: Any, run: RamRun) -> RamOptions:
    carried = RamOptions.model_validate(options.model_dump())
    carried._run = run
    return carried


def patch_planner(plan: Any) -> None:
    """Add the pre-pass, lambdas and statistics to the plan of a RAM recipe."""

    def make(original: Callable[..., Any], to_disk: bool) -> Callable[..., Any]:
        def planned(self: Any, *args: Any, **kwargs: Any) -> Any:
            if not is_ours(self.config.merge_method):
                return original(self, *args, **kwargs)
            carried = self.options._run if isinstance(self.options, RamOptions) else None
            run = carried or RamRun.checked(self.config, self.options)
            out_path = (args[0] if args else kwargs["out_path"]) if to_disk else None
            targets = original(self, *args, **kwargs)
            return attach_ram_plan(targets, self.options, out_path, run, tensor_modules(self))

        return planned

    wrap("mergekit.plan", "MergePlanner.plan_to_disk", lambda original: make(original, True))
    wrap("mergekit.plan", "MergePlanner.plan_in_memory", lambda original: make(original, False))


def tensor_modules(planner: Any) -> dict[str, str]:
    """Each output tensor's module in a merge of several (a ``modules:`` recipe; mergekit's text
    decoder, vision tower, ...), from the output model's architecture; empty for one module."""
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


@dataclass(frozen=True)
class PlannedMerge:
    """A RAM merge's merge tasks, the same as plain data, and its modules (output tensor -> module)."""

    merge_tasks: list[Any]
    tensors: list[PlannedTensor]
    modules: dict[str, str]

    @classmethod
    def of(cls, merge_tasks: Sequence[Any], modules: dict[str, str]) -> PlannedMerge:
        return cls(list(merge_tasks), [planned_tensor(task) for task in merge_tasks], modules)

    def settings(self, method: str, headers: HeaderCache) -> MergeSettings:
        """The merge's settings, once the inputs' headers are checked."""
        dtypes = check_tensors(self.tensors, headers).dtypes
        return merge_settings(method, [tensor.parameters for tensor in self.tensors], dtypes, self.modules)

    def finetunes(self) -> list[str]:
        return list(dict.fromkeys(model for tensor in self.tensors for model in tensor.finetunes))


def attach_ram_plan(
    targets: list[Any], options: Any, out_path: Optional[str], run: RamRun, modules: Optional[dict[str, str]] = None
) -> list[Any]:
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
    plan = PlannedMerge.of(merge_tasks, modules or {})
    settings = plan.settings(merge_tasks[0].method_name if merge_tasks else "ram", run.headers)
    finetunes = plan.finetunes()
    if settings.method == "ram":
        LOG.info("merge_method 'ram' is mergekit-ram's float32 RAM (it replaces mergekit's built-in 'ram')")
    statistics: Optional[RamStatistics] = None
    if settings.needs_counts(finetunes):
        statistics = settings.statistics(counted_prepass(plan, options, run), source="pre-pass")
        log_statistics(statistics)
        run.receive(statistics)
    applied = settings.applied(finetunes, statistics)
    mode: Mode = "merge" if statistics is not None else "merge+count"
    merging = [asking(task, mode, applied) for task in merge_tasks]
    tasks = merging if statistics is not None else [take_tensor(task) for task in merging]
    counts = () if statistics is not None else tuple(take_counts(task) for task in merging)

    replaced = {id(old): old.model_copy(update={"tensor_task": new}) for old, new in zip(outputs, tasks)}
    rewritten: list[Any] = []
    finalize = None
    for task in targets:
        if isinstance(task, FinalizeModel):
            task = finalize = task.model_copy(
                update={"tensor_save_tasks": tuple(replaced.get(id(t), t) for t in task.tensor_save_tasks)}
            )
        rewritten.append(replaced.get(id(task), task))
    computed = Computed(statistics) if statistics is not None else None
    record = RecordStatistics(
        out_path=out_path, settings=settings, deliver=run.receive, computed=computed, counts=counts, after=finalize
    )
    return [*rewritten, record]


def counted_prepass(plan: PlannedMerge, options: Any, run: RamRun) -> list[TensorCounts]:
    """The pre-pass counts, from the cache when nothing they depend on changed."""
    with opened(run.cache, plan.tensors) as entry:
        counts = entry.load(plan.tensors, run.headers) if entry is not None else None
        if counts is None:
            started = time.perf_counter()
            LOG.info("ram_plus pre-pass: counting changed parameters over %d tensors", len(plan.merge_tasks))
            counts = run_prepass(plan.merge_tasks, options)
            LOG.info("ram_plus pre-pass done in %.1f s", time.perf_counter() - started)
            if entry is not None:
                entry.store(counts)
    return [value for value in counts if value is not None]


def run_prepass(merge_tasks: Sequence[Any], options: Any) -> list[Optional[TensorCounts]]:
    """One streaming pass over the merge's own inputs: each merge task, asked to count, run by
    mergekit; counts per merge task (None where mergekit passes a tensor through)."""
    count_tasks = [asking(task, "count", {}) for task in merge_tasks]
    order = {task: index for index, task in enumerate(count_tasks)}
    if options.multi_gpu:  # the executors and devices run_merge itself would take
        executor = internal("mergekit.multigpu_executor", "MultiGPUExecutor")(
            targets=count_tasks, storage_device=None if options.low_cpu_memory else "cpu"
        )
        pairs = executor.run(quiet=options.quiet)
    else:
        storage = options.device if options.low_cpu_memory else "cpu"
        executor = Executor(count_tasks, math_device=options.device, storage_device=storage)
        pairs = executor.run(quiet=options.quiet, desc="RAM+ pre-pass")
    counts: list[Optional[TensorCounts]] = [None] * len(count_tasks)
    for task, value in pairs:
        counts[order[task]] = value if isinstance(value, TensorCounts) else None
    return counts


def plan_merge(config: Any, options: Any) -> PlannedMerge:
    """Plan a recipe exactly as ``run_merge`` would, without running it (the probe): mergekit's own
    planner, as it was before the wrapper above."""
    get_architecture_info = internal("mergekit.architecture", "get_architecture_info")
    loaders = internal("mergekit.io.tasks", "LoaderCache")()
    arch_info = get_architecture_info(config, options)
    loaders.setup(options=options)
    for model in config.referenced_models():
        loaders.get(model)
    out_config = internal("mergekit.merge", "_model_out_config")(config, arch_info, options.trust_remote_code)
    planner = MergePlanner(config, arch_info, options=options, out_model_config=out_config)
    plan_to_disk = inspect.unwrap(internal("mergekit.plan", "MergePlanner.plan_to_disk"))
    targets = plan_to_disk(planner, out_path="")  # planned, never run: nothing is written
    return PlannedMerge.of(
        [task.tensor_task for task in targets if isinstance(task, SaveTensor)], tensor_modules(planner)
    )


def probe_statistics(config: Any, options: Any, run: RamRun) -> RamStatistics:
    """Only the pre-pass of a recipe of these methods (the probe): its statistics."""
    plan = plan_merge(config, options)
    settings = plan.settings(config.merge_method, run.headers)
    return settings.statistics(counted_prepass(plan, options, run), source="pre-pass")
