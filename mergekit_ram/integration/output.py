"""``run_merge`` (so ``mergekit-yaml``, each ``mergekit-multi`` stage) and ``mergekit-pytorch`` write a
RAM merge through ``staging``'s output transaction: weights, config, tokenizer, card and statistics
reach the output folder together, or not at all. An output folder that is, or is inside, a folder the
merge reads is refused first. Other methods run exactly as mergekit has them.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, NamedTuple, Optional, Sequence

import pydantic
import yaml
from huggingface_hub import constants as hub_constants

from mergekit_ram import staging
from mergekit_ram.cache import CacheSettings
from mergekit_ram.checks import HeaderCache
from mergekit_ram.errors import InputError
from mergekit_ram.files import write_atomically
from mergekit_ram.integration.internals import MergekitMovedError, check_internals, internal, wrap
from mergekit_ram.integration.merge import Plan, Prepared, plan_merge, prepare
from mergekit_ram.integration.recipes import check_config
from mergekit_ram.integration.registry import is_ours
from mergekit_ram.interrupts import MergeInterrupted
from mergekit_ram.published import append_card_section, report_summary
from mergekit_ram.recipe_file import Stage
from mergekit_ram.stats.data import RamStatistics
from mergekit_ram.stats.schema import STATISTICS_FILE, statistics_to_json

RawPyTorchMergeConfig: Any = internal("mergekit.scripts.merge_raw_pytorch", "RawPyTorchMergeConfig")
plan_flat_merge: Any = internal("mergekit.scripts.merge_raw_pytorch", "plan_flat_merge")
Executor: Any = internal("mergekit.graph", "Executor")


class InputFolder(NamedTuple):
    """A folder a merge reads, ``label`` naming the input; ``whole``: an output inside it is refused too
    (False for the folder of one input file, ``mergekit-pytorch``'s)."""

    label: str
    folder: str
    whole: bool = True


def refuse_input_folder(out_path: str, inputs: Iterable[InputFolder]) -> None:
    """Refuse an output folder that is, or is inside, a folder the merge reads, however it is spelled
    (links, ``..``, bind mounts: compared by ``_folder_key``, up each folder above the output)."""
    resolved = Path(os.path.realpath(out_path))
    chain = [_folder_key(str(folder)) for folder in (resolved, *resolved.parents)]
    for item in inputs:
        key = _folder_key(item.folder)
        if key == chain[0]:
            raise InputError(
                f"the output folder {out_path} is the folder of the input {item.label}: the merge would overwrite "
                "that input; choose another output folder"
            )
        if item.whole and key in chain[1:]:
            raise InputError(
                f"the output folder {out_path} is inside {item.folder}, the folder of the input {item.label}: "
                "the merge would write into that input; choose an output folder outside it"
            )


def _folder_key(path: str) -> tuple[Any, ...]:
    """Its device and inode if it exists, else its resolved path (a stage's output, not yet made)."""
    try:
        status = os.stat(path)
    except OSError:
        return ("path", os.path.realpath(path))
    return ("inode", status.st_dev, status.st_ino)


class Transaction:
    """``staging.output_transaction`` into ``out_path`` that tells, after a Ctrl-C, what it holds: publishing
    renames the files written (their device and inode recorded), so the new merge where all are there."""

    def __init__(self, out_path: str) -> None:
        self.out_path = out_path
        self.written: Optional[dict[str, Optional[tuple[int, int]]]] = None

    @contextlib.contextmanager
    def staged(self) -> Iterator[str]:
        with staging.output_transaction(self.out_path) as staged:
            yield staged
            self.written = {name: _identity(os.path.join(staged, name)) for name in os.listdir(staged)}

    def interrupted(self) -> MergeInterrupted:
        out, written = self.out_path, self.written or {}
        moved = sum(_identity(os.path.join(out, name)) == identity for name, identity in written.items())
        if self.written is None or not moved:
            return MergeInterrupted(f"Interrupted: nothing was published; {out} holds what it held before")
        if moved == len(written):
            return MergeInterrupted(f"Interrupted after the merge was published: {out} holds the complete new merge")
        return MergeInterrupted(
            f"Interrupted while publishing, which could not be undone: {out} is marked {staging.MARKER_FILE}; "
            "rerun the merge"
        )


def _identity(path: str) -> Optional[tuple[int, int]]:
    try:
        status = os.stat(path, follow_symlinks=False)
    except OSError:
        return None
    return status.st_dev, status.st_ino


def patch_run_merge(merge: Any) -> None:
    """RAM merges: inputs' folders refused, the recipe checked, ``integration.merge``'s sequence, staged."""

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def run_merge(merge_config: Any, out_path: str, options: Any, config_source: Optional[str] = None) -> Any:
            if not is_ours(merge_config.merge_method):
                return original(merge_config, out_path, options=options, config_source=config_source)
            transaction = Transaction(out_path)
            try:
                check_internals()
                refuse_input_folder(out_path, _model_folders(merge_config, options))
                headers, cache = HeaderCache(), CacheSettings.from_environment()
                check_config(
                    merge_config.merge_method, merge_config, headers, config_source, allow_crimes=options.allow_crimes
                )
                with transaction.staged() as staged:
                    plan = plan_merge(merge_config, options)
                    prepared = prepare(merge_config, plan, options, headers, cache, os.path.join(staged, COUNTS_FILE))
                    source = config_source or merge_config.to_yaml()  # the recipe as given, not as run
                    result = original(prepared.config, staged, options=options, config_source=source)
                    if not os.path.isdir(staged):
                        raise MergekitMovedError(
                            f"mergekit moved its output out of {staged} (an architecture with "
                            "post_fill_parameters); mergekit-ram cannot publish it"
                        )
                    statistics = finish(staged, prepared, options.write_model_card)
                if not options.quiet:
                    report_summary(out_path, statistics)
            except KeyboardInterrupt:
                raise transaction.interrupted() from None
            return result

        return run_merge

    wrap("mergekit.merge", "run_merge", make)
    patched = internal("mergekit.merge", "run_merge")
    for name in ("mergekit.scripts.run_yaml", "mergekit.scripts.multimerge"):
        module = sys.modules.get(name)
        if module is not None and getattr(module, "run_merge", None) is not patched:
            module.run_merge = patched  # type: ignore[attr-defined]  # imported by name before the patch


#: Where a merge without a pre-pass counts, in its staging folder (removed before the folder is published).
COUNTS_FILE = ".mergekit-ram-counts.jsonl"


def finish(staged: str, prepared: Prepared, card: bool) -> RamStatistics:
    """The merge's statistics, written beside the weights (and into the card) in the staging folder."""
    statistics = prepared.final_statistics()
    if prepared.counts_to is not None and os.path.exists(prepared.counts_to):
        os.unlink(prepared.counts_to)
    write_atomically(os.path.join(staged, STATISTICS_FILE), statistics_to_json(statistics))
    if card:
        append_card_section(staged, statistics)
    return statistics


def _model_folders(merge_config: Any, options: Any, made: Sequence[str] = ()) -> Iterator[InputFolder]:
    """Every folder the recipe reads: each model reference anywhere in it and its LoRA, and
    ``--lora-merge-cache``. ``made``: what an earlier ``mergekit-multi`` stage writes, local though not yet there."""
    for reference in _references(merge_config):
        label = str(reference)
        for path in (reference.model, reference.lora):
            if path is not None:
                yield InputFolder(label, _local_folder(path.path, options, made))
        if reference.lora is not None and options.lora_merge_cache:
            yield InputFolder(label, os.path.expanduser(options.lora_merge_cache))


def _references(value: Any) -> Iterator[Any]:
    """Every mergekit ``ModelReference`` (a model and its LoRA) anywhere in a recipe object."""
    if isinstance(value, pydantic.BaseModel) and {"model", "lora"} <= set(type(value).model_fields):
        yield value
    elif isinstance(value, pydantic.BaseModel):
        for name in type(value).model_fields:
            yield from _references(getattr(value, name))
    elif isinstance(value, (dict, list, tuple)):
        for item in value.values() if isinstance(value, dict) else value:
            yield from _references(item)


def _local_folder(path: str, options: Any, made: Sequence[str]) -> str:
    """The folder mergekit reads for ``path``: itself if local, else a Hub id's folder in the Hub cache."""
    local = os.path.expanduser(path)
    if os.path.exists(local) or path in made:
        return local
    cache = options.transformers_cache or hub_constants.HF_HUB_CACHE
    return os.path.join(cache, "models--" + path.replace("/", "--"))


def refuse_stage_outputs(stages: Sequence[Stage], intermediate_dir: str, out_path: Optional[str], options: Any) -> None:
    """``mergekit-multi``: no RAM stage writes into, or inside, a folder any stage reads, but for the stages
    that read its output (``-I``/<name>, ``--out-path`` for the unnamed final stage)."""
    made = [os.path.join(intermediate_dir, stage.name) for stage in stages if stage.name is not None]
    readers = {stage.name: "the final merge" if stage.name is None else f"stage {stage.name}" for stage in stages}
    for stage in stages:
        output = out_path if stage.name is None else os.path.join(intermediate_dir, stage.name)
        if output is None or not is_ours(stage.config.merge_method):
            continue
        inputs = [
            InputFolder(f"{item.label} (read by {readers[reader.name]})", item.folder, item.whole)
            for reader in stages
            for item in _model_folders(reader.config, options, made)
            if not (stage.name in reader.depends_on and item.folder == output)
        ]
        refuse_input_folder(output, inputs)


def raw_pytorch_merge(arguments: Mapping[str, Any], options: Any) -> None:
    """``mergekit-pytorch`` for a RAM recipe, run by the console scripts' hook in its place: mergekit's own
    steps (its flat plan, its Executor) with the merge step's sequence, inside the output transaction."""
    config_path, out_path = arguments["config_path"], arguments["out_path"]
    with open(config_path, encoding="utf-8") as handle:
        source = handle.read()
    config = RawPyTorchMergeConfig.model_validate(yaml.safe_load(source))
    check_internals()
    files = [entry.model for entry in config.models] + ([config.base_model] if config.base_model else [])
    folders = [InputFolder(file, os.path.dirname(os.path.abspath(file)), False) for file in files]
    folders += [InputFolder(file, os.path.dirname(os.path.realpath(file)), False) for file in files]
    folders += [InputFolder(file, file) for file in files if os.path.isdir(file)]
    refuse_input_folder(out_path, folders)
    transaction = Transaction(out_path)
    try:
        headers, cache = HeaderCache(), CacheSettings.from_environment()
        check_config(config.merge_method, config, headers, source, allow_crimes=options.allow_crimes)
        options.apply_global_options()
        union, intersection = arguments["tensor_union"], arguments["tensor_intersection"]
        with transaction.staged() as staged:
            planned = plan_flat_merge(config, "", union, intersection, options)
            plan = Plan.of(config.merge_method, [task.tensor_task for task in planned if hasattr(task, "tensor_task")])
            prepared = prepare(config, plan, options, headers, cache, os.path.join(staged, COUNTS_FILE))
            targets = plan_flat_merge(prepared.config, staged, union, intersection, options)
            storage = options.device if options.low_cpu_memory else "cpu"
            Executor(targets, math_device=options.device, storage_device=storage).execute()
            statistics = finish(staged, prepared, False)
        if not options.quiet:
            report_summary(out_path, statistics)
    except KeyboardInterrupt:
        raise transaction.interrupted() from None
