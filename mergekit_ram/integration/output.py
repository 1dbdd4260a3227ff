"""``run_merge`` (``mergekit-yaml``, ``mergekit-multi``) and ``mergekit-pytorch`` write a RAM merge through
``staging``'s output transaction, all files or none; an output folder inside an input's is refused first.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, NamedTuple, Optional, Sequence

import yaml
from huggingface_hub import constants as hub_constants

from mergekit_ram import staging
from mergekit_ram.cache import CacheSettings
from mergekit_ram.checks import HeaderCache
from mergekit_ram.errors import InputError
from mergekit_ram.files import write_atomically
from mergekit_ram.integration.internals import MergekitMovedError, check_internals, internal, wrap
from mergekit_ram.integration.merge import Plan, executor, plan_merge, prepare
from mergekit_ram.integration.recipes import check_config, recipe_nodes
from mergekit_ram.integration.registry import is_ours
from mergekit_ram.interrupts import MergeInterrupted
from mergekit_ram.published import append_card_section, report_summary
from mergekit_ram.recipe_file import Stage
from mergekit_ram.stats.data import RamStatistics
from mergekit_ram.stats.schema import STATISTICS_FILE, statistics_to_json

RawPyTorchMergeConfig: Any = internal("mergekit.scripts.merge_raw_pytorch", "RawPyTorchMergeConfig")
plan_flat_merge: Any = internal("mergekit.scripts.merge_raw_pytorch", "plan_flat_merge")


class InputFolder(NamedTuple):
    """A folder a merge reads; ``whole``: an output inside it is refused too (not for one input file's)."""

    label: str
    folder: str
    whole: bool = True


def refuse_input_folder(out_path: str, inputs: Iterable[InputFolder]) -> None:
    """Refuse an output folder that is, or is inside, a folder the merge reads, however it is spelled."""
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


def _folder_key(path: str) -> Any:
    """Device and inode (links, bind mounts), else the resolved path (a stage's output, not yet made)."""
    return _identity(path, follow_symlinks=True) or os.path.realpath(path)


class Transaction:
    """``staging.output_transaction`` that tells what ``out_path`` holds after a Ctrl-C (files renamed in)."""

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
        if not moved:
            return MergeInterrupted(f"Interrupted: nothing was published; {out} holds what it held before")
        if moved == len(written):
            return MergeInterrupted(f"Interrupted after the merge was published: {out} holds the complete new merge")
        return MergeInterrupted(
            f"Interrupted while publishing, which could not be undone: {out} is marked {staging.MARKER_FILE}; "
            "rerun the merge"
        )


def _identity(path: str, follow_symlinks: bool = False) -> Optional[tuple[int, int]]:
    try:
        status = os.stat(path, follow_symlinks=follow_symlinks)
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
                check_config(merge_config, headers, config_source, allow_crimes=options.allow_crimes)
                with transaction.staged() as staged:
                    plan = plan_merge(merge_config, options)
                    config, final = prepare(
                        merge_config, plan, options, headers, cache, os.path.join(staged, COUNTS_FILE)
                    )
                    source = config_source or merge_config.to_yaml()  # the recipe as given, not as run
                    result = original(config, staged, options=options, config_source=source)
                    if not os.path.isdir(staged):
                        raise MergekitMovedError(
                            f"mergekit moved its output out of {staged} (an architecture with "
                            "post_fill_parameters); mergekit-ram cannot publish it"
                        )
                    statistics = finish(staged, final(), options.write_model_card)
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


def finish(staged: str, statistics: RamStatistics, card: bool) -> RamStatistics:
    """The merge's statistics, written beside the weights (and into the card) in the staging folder."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(staged, COUNTS_FILE))
    write_atomically(os.path.join(staged, STATISTICS_FILE), statistics_to_json(statistics))
    if card:
        append_card_section(staged, statistics)
    return statistics


def _model_folders(merge_config: Any, options: Any, made: Sequence[str] = ()) -> Iterator[InputFolder]:
    """Each model reference's folders and ``--lora-merge-cache``; ``made``: earlier ``mergekit-multi`` stages'."""
    for _, reference in recipe_nodes(merge_config):
        if not {"model", "lora"} <= set(type(reference).model_fields):
            continue
        for path in (reference.model, reference.lora):
            if path is not None:
                yield InputFolder(str(reference), _local_folder(path.path, options, made))
        if reference.lora is not None and options.lora_merge_cache:
            yield InputFolder(str(reference), os.path.expanduser(options.lora_merge_cache))


def _local_folder(path: str, options: Any, made: Sequence[str]) -> str:
    """The folder mergekit reads for ``path``: itself if local, else its folder in the Hub cache."""
    local = os.path.expanduser(path)
    if os.path.exists(local) or path in made:
        return local
    cache = options.transformers_cache or hub_constants.HF_HUB_CACHE
    return os.path.join(cache, "models--" + path.replace("/", "--"))


def refuse_stage_outputs(stages: Sequence[Stage], intermediate_dir: str, out_path: Optional[str], options: Any) -> None:
    """``mergekit-multi``: no RAM stage writes into a folder any stage reads, but for the stages reading its output."""
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


def raw_pytorch_merge(arguments: Mapping[str, Any], options: Any, source: str) -> None:
    """``mergekit-pytorch`` for a RAM recipe (``source``, its file's text as checked): mergekit's flat plan and
    Executor, inside the output transaction."""
    out_path = arguments["out_path"]
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
        check_config(config, headers, source, allow_crimes=options.allow_crimes)
        options.apply_global_options()
        union, intersection = arguments["tensor_union"], arguments["tensor_intersection"]
        with transaction.staged() as staged:
            planned = plan_flat_merge(config, "", union, intersection, options)
            plan = Plan.of(config.merge_method, planned)
            ram_config, final = prepare(config, plan, options, headers, cache, os.path.join(staged, COUNTS_FILE))
            targets = plan_flat_merge(ram_config, staged, union, intersection, options)
            executor(targets, options).execute()
            statistics = finish(staged, final(), False)
        if not options.quiet:
            report_summary(out_path, statistics)
    except KeyboardInterrupt:
        raise transaction.interrupted() from None
