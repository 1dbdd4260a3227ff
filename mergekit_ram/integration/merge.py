"""One RAM merge around mergekit's planner: plan -> counts (cache or pre-pass) -> lambdas into the recipe.

rho is a whole-model statistic and mergekit merges one tensor at a time, so the counts come first; when every
lambda is known from the recipe, no pre-pass runs and the methods count each group as they merge it, into the
merge's ``Session``.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import time
from dataclasses import replace
from typing import Any, Callable, Iterable, Iterator, Mapping, NamedTuple, Optional, Sequence

import torch
import tqdm
from pydantic import BaseModel

from mergekit_ram.cache import CacheSettings, opened
from mergekit_ram.checks import HeaderCache, check_tensors
from mergekit_ram.device import check_device
from mergekit_ram.errors import MergekitMovedError
from mergekit_ram.integration.internals import internal, version_refusal
from mergekit_ram.integration.methods import Session, non_finite_error
from mergekit_ram.integration.recipes import check_config, model_lists, whole_merge_defaults
from mergekit_ram.kernel import NonFiniteInputError, count_overlaps
from mergekit_ram.lambdas import Applied, MergeRule, Resolved, merge_rule
from mergekit_ram.planned import PlannedTensor, TensorInput
from mergekit_ram.stats.data import RamStatistics, TensorCounts
from mergekit_ram.stats.render import log_statistics

LOG = logging.getLogger(__name__)

MergePlanner: Any = internal("mergekit.plan", "MergePlanner")
Executor: Any = internal("mergekit.graph", "Executor")
LoaderCache: Any = internal("mergekit.io.tasks", "LoaderCache")
# The planned graph: each output tensor's save, its merge task, the inputs gathered (or aligned) for it.
SaveTensor: Any = internal("mergekit.io.tasks", "SaveTensor")
ExecuteMergeMethodTask: Any = internal("mergekit.merge_methods.task_adapter", "ExecuteMergeMethodTask")
internal("mergekit.io.tasks", "GatherTensors")  # the inputs of a merge task, or of its alignment
ALIGNED: tuple[Any, ...] = (
    internal("mergekit.tokenizer.embed", "PermutedVocabulary"),
    internal("mergekit.tokenizer.truncate", "TruncatedVocabulary"),
)
TensorDictWrapper: Any = internal("mergekit.merge_methods.task_adapter", "TensorDictWrapper")  # mergekit-pytorch's
internal("mergekit.scripts.merge_raw_pytorch", "SimpleLoadTensor")  # its values
internal("mergekit.architecture.base", "WeightInfo")  # output_weight, weight_info's values
internal("mergekit.io.lazy_tensor_loader", "LazyTensorLoader")  # LoaderCache().get(model)
internal("mergekit.io.lazy_tensor_loader", "ShardedTensorIndex")  # its index


class Plan(NamedTuple):
    """A RAM merge as mergekit plans it: merge tasks, the same as plain data, tensor -> module, rule, and each
    model reference's name in the statistics (``names``: one agent spelt two ways in two places is one)."""

    tasks: list[Any]
    tensors: list[PlannedTensor]
    modules: dict[str, str]
    rule: MergeRule
    names: dict[str, str]

    @classmethod
    def of(cls, config: Any, targets: Sequence[Any], modules: Optional[dict[str, str]] = None) -> Plan:
        """From the planner's targets: the merge tasks of the recipe's method behind them."""
        method, names = config.merge_method, model_names(config)
        tasks = [target.tensor_task for target in targets if isinstance(target, SaveTensor)]
        ours = [task for task in tasks if isinstance(task, ExecuteMergeMethodTask) and task.method_name == method]
        resolved = [
            Resolved(
                task.output_weight.name,
                dict(task.parameters.items()),
                {
                    names.get(str(m), str(m)): dict(task.input_parameters[m].items())
                    for m in task.model_order
                    if m != task.base_model
                },
            )
            for task in ours
        ]
        rule = merge_rule(method, resolved, whole_merge_defaults(method))
        return cls(ours, [planned_tensor(task) for task in ours], modules or {}, rule, names)

    def finetunes(self) -> list[str]:
        """The fine-tuned models by their names, in the order the plan first has them."""
        return list(dict.fromkeys(self.names.get(m, m) for tensor in self.tensors for m in tensor.finetunes))

    def checked(self, headers: HeaderCache) -> dict[str, set[str]]:
        """Every input checked from its header (``check_tensors``); each model's checkpoint dtypes, by its name."""
        found: dict[str, set[str]] = {}
        for model, dtypes in check_tensors(self.tensors, headers).dtypes.items():
            found.setdefault(self.names.get(model, model), set()).update(dtypes)
        return found

    def named(self, counts: Iterable[TensorCounts]) -> list[TensorCounts]:
        """``counts`` with each model by its name."""
        return [replace(found, models=tuple(self.names.get(m, m) for m in found.models)) for found in counts]


def model_names(config: Any) -> dict[str, str]:
    """Each model reference (as mergekit writes it) -> its name in the statistics: the first reference in the
    recipe to the same model, as the same-list check tells models apart."""
    first: dict[Any, str] = {}
    return {
        model.label: first.setdefault(model.key, model.label) for _, models in model_lists(config) for model in models
    }


def check_setting(options: Any) -> None:
    """The installed mergekit is one the methods support, and the CUDA device asked for exists."""
    refusal = version_refusal()
    if refusal is not None:
        raise MergekitMovedError(refusal)
    device = str(options.device or "cpu")
    flag = "--gpu-rich" if getattr(options, "gpu_rich", False) else "--cuda" if options.cuda else f"--device {device}"
    check_device(device, flag)


def plan_merge(config: Any, options: Any) -> Plan:
    """Plan a recipe exactly as ``run_merge`` will (on a copy; nothing runs or is written)."""
    config = config.model_copy(deep=True)  # mergekit's planner normalizes the recipe in place
    arch_info = internal("mergekit.architecture", "get_architecture_info")(config, options)
    loaders = LoaderCache()
    loaders.setup(options=options)
    for model in tqdm.tqdm(config.referenced_models(), desc="Warmup loader cache", disable=options.quiet):
        loaders.get(model)  # as run_merge warms it up (which then finds every loader ready)
    out_config = internal("mergekit.merge", "_model_out_config")(config, arch_info, options.trust_remote_code)
    planner = MergePlanner(config, arch_info, options=options, out_model_config=out_config)
    targets = planner.plan_to_disk(out_path="")  # planned, never run
    modules: dict[str, str] = {}
    if len(planner.config.modules or {}) > 1:  # each output tensor's module in a merge of several
        for module in planner.config.modules:
            definition = planner.arch_info.modules[module]
            weights = definition.architecture.all_weights(config=planner.out_model_config)
            modules.update(((definition.weight_prefix or "") + weight.name, module) for weight in weights)
    return Plan.of(config, targets, modules)


def planned_tensor(task: Any) -> PlannedTensor:
    source = task.gather_tensors
    return PlannedTensor(
        name=task.output_weight.name,
        optional=task.output_weight.optional,
        vocabulary_axis=task.output_weight.vocabulary_axis,
        reshaped=isinstance(source, ALIGNED),  # tokenizer alignment or truncation around the loads
        base=str(task.base_model),
        finetunes=tuple(str(model) for model in task.model_order if model != task.base_model),
        inputs=tuple(_task_inputs(source)),
        epsilon=float(task.parameters["epsilon"]),
        graph=describe(source),
    )


def _task_inputs(source: Any) -> Iterator[TensorInput]:
    if isinstance(source, TensorDictWrapper):  # mergekit-pytorch: a file per model
        for model, load in source.tensors.items():
            yield TensorInput(str(model), load.model, load.tensor_name)
        return
    gather = source.gather_tensors if isinstance(source, ALIGNED) else source
    for model, weight in gather.weight_info.items():
        index = LoaderCache().get(model).index
        names = [weight.name, *(weight.aliases or ()), *(weight.tied_names or ())]
        name = next((n for n in names if n in index.tensor_paths), None)
        if name is None:
            yield TensorInput(str(model), None, weight.name)
        else:
            yield TensorInput(str(model), os.path.join(index.base_path, index.tensor_paths[name]), name)


def describe(value: Any) -> str:
    """A canonical text for a planned task graph (the cache key)."""
    if isinstance(value, BaseModel):
        fields = ", ".join(f"{name}={describe(getattr(value, name))}" for name in type(value).model_fields)
        return f"{type(value).__name__}({fields})"
    if callable(getattr(value, "items", None)):
        items = sorted((describe(key), describe(item)) for key, item in value.items())
        return "{" + ", ".join(f"{key}: {item}" for key, item in items) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(describe(item) for item in value) + "]"
    return repr(value)


def counted(plan: Plan, options: Any, cache: CacheSettings, headers: HeaderCache) -> list[TensorCounts]:
    """The pre-pass counts, from the cache when nothing they depend on changed."""
    with opened(cache, plan.tensors) as entry:
        counts = entry.load(plan.tensors, headers) if entry is not None else None
        if counts is None:
            started = time.perf_counter()
            LOG.info("ram_plus pre-pass: counting changed parameters over %d tensors", len(plan.tasks))
            counts = run_prepass(plan, options)
            LOG.info("ram_plus pre-pass done in %.1f s", time.perf_counter() - started)
            if entry is not None:
                entry.store(counts)
    return plan.named(value for value in counts if value is not None)


def run_prepass(plan: Plan, options: Any) -> list[Optional[TensorCounts]]:
    """One streaming pass of the merge tasks' input sub-graphs through mergekit's Executor."""
    by_source: dict[Any, list[int]] = {}
    for index, task in enumerate(plan.tasks):
        by_source.setdefault(task.gather_tensors, []).append(index)
    counts: list[Optional[TensorCounts]] = [None] * len(plan.tasks)
    for source, tensors in executor(list(by_source), options).run(quiet=options.quiet, desc="RAM+ pre-pass"):
        for index in by_source[source]:
            counts[index] = _counted_task(plan.tasks[index], plan.tensors[index], tensors)
        del tensors
    return counts


def executor(targets: list[Any], options: Any) -> Any:
    """mergekit's Executor as ``run_merge`` builds it: tensors stay on the device only under ``low_cpu_memory``."""
    storage = options.device if options.low_cpu_memory else "cpu"
    return Executor(targets, math_device=options.device, storage_device=storage)


def _counted_task(task: Any, planned: PlannedTensor, tensors: Mapping[Any, Any]) -> Optional[TensorCounts]:
    """Counted as ``ExecuteMergeMethodTask`` hands the inputs over; None where mergekit does not merge it."""
    present = [(model, tensors[model]) for model in task.model_order if tensors.get(model) is not None]
    base = next((item for item in present if item[0] == task.base_model), None)
    if base is None or not all(tensor.is_floating_point() for _, tensor in present):
        return None
    finetunes = [item for item in present if item[0] != task.base_model]
    dtype = None if task.dtype is None else getattr(torch, task.dtype)
    return count_tensors(planned.name, base, finetunes, planned.epsilon, dtype)


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


def prepare(
    config: Any, plan: Plan, options: Any, headers: HeaderCache, cache: CacheSettings
) -> tuple[Any, Session, Callable[[], RamStatistics]]:
    """The checks, the pre-pass where a lambda needs the global rho: the recipe with the lambdas, the merge's
    session (counting where nothing counted before), and its statistics once merged."""
    dtypes = plan.checked(headers)
    finetunes = plan.finetunes()
    out_dtype = None if config.out_dtype is None else getattr(torch, str(config.out_dtype).removeprefix("torch."))
    if plan.rule.method == "ram":
        LOG.info("merge_method 'ram' is mergekit-ram's float32 RAM (it replaces mergekit's built-in 'ram')")
    if not plan.rule.needs_counts(finetunes):
        session = Session(out_dtype, counting=True)
        return config, session, functools.partial(merged_statistics, plan, dtypes, session)
    counts = counted(plan, options, cache, headers)
    statistics = plan.rule.statistics(counts, "pre-pass", dtypes, plan.modules)
    log_statistics(statistics)
    applied = {
        model: value for model, value in plan.rule.applied(finetunes, statistics).items() if not plan.rule.pin(model)
    }
    return with_lambdas(config, applied, plan.names), Session(out_dtype), lambda: statistics


def merged_statistics(plan: Plan, dtypes: dict[str, set[str]], session: Session) -> RamStatistics:
    """The statistics of the counts the merge's methods took, in the plan's order."""
    order = {tensor.name: index for index, tensor in reversed(list(enumerate(plan.tensors)))}
    counts = sorted(plan.named(session.counts), key=lambda found: order.get(found.name, len(order)))
    statistics = plan.rule.statistics(counts, "merge", dtypes, plan.modules)
    log_statistics(statistics)
    return statistics


def with_lambdas(config: Any, applied: Mapping[str, Applied], names: Mapping[str, str]) -> Any:
    """A copy of the recipe with each model's ``lambda`` (and finite ``rho``) in its ``parameters``, wherever the
    recipe names it (``names``: the name its lambda is under)."""
    return _injected(config, {label: applied[name] for label, name in names.items() if name in applied})


def _injected(node: Any, applied: Mapping[str, Applied]) -> Any:
    if isinstance(node, BaseModel):
        fields = type(node).model_fields
        update = {
            name: _injected(getattr(node, name), applied)
            for name in fields
            if name not in ("parameters", "model") and isinstance(getattr(node, name), (BaseModel, list, dict))
        }
        entry: Any = node  # a model entry: ``model`` and ``parameters`` (fields the BaseModel type does not know)
        if "model" in fields and "parameters" in fields and str(entry.model) in applied:
            lam, rho = applied[str(entry.model)]
            own = {"lambda": lam, **({"rho": rho} if rho is not None and math.isfinite(rho) else {})}
            update["parameters"] = {**(entry.parameters or {}), **own}
        return node.model_copy(update=update) if update else node
    if isinstance(node, list):
        return [_injected(item, applied) for item in node]
    if isinstance(node, dict):
        return {key: _injected(item, applied) for key, item in node.items()}
    return node


def probe_statistics(config: Any, options: Any, refresh: bool = False) -> RamStatistics:
    """The probe: only the checks and the pre-pass; ``refresh`` recomputes counts the cache has."""
    headers = HeaderCache()
    cache = CacheSettings.from_environment()
    check_config(config, headers, options)
    plan = plan_merge(config, options)
    dtypes = plan.checked(headers)
    counts = counted(plan, options, replace(cache, mode="refresh") if refresh else cache, headers)
    return plan.rule.statistics(counts, "pre-pass", dtypes, plan.modules)
