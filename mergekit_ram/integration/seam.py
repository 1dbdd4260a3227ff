"""The seam: mergekit's ``run_merge`` (``mergekit-yaml``, ``mergekit-multi``, the Python API) and the entry
``mergekit-pytorch`` plans through (``plan_flat_merge``) run a RAM merge as one sequence of functions:

    checks (once) -> output transaction -> plan (mergekit's planner, unpatched) -> counts (cache, pre-pass, or
    the merge's own) -> lambdas into the recipe -> mergekit's own merge into the staging folder, the methods
    bound to this merge's session -> statistics file and card -> publish

Any other method runs as mergekit alone. The plugin's errors are ``click.ClickException``s: every console
script prints them as one line; Ctrl-C is one line saying what the output folder holds, exit status 130.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, NamedTuple, Optional

from huggingface_hub import constants as hub_constants

from mergekit_ram import interrupts, staging
from mergekit_ram.cache import CacheSettings
from mergekit_ram.checks import HeaderCache
from mergekit_ram.errors import InputError, MergeInterrupted, MergekitMovedError, reported
from mergekit_ram.files import write_atomically
from mergekit_ram.integration.merge import Plan, check_setting, executor, plan_merge, prepare
from mergekit_ram.integration.recipes import check_config, check_method_name, model_references
from mergekit_ram.integration.registration import bound, ours
from mergekit_ram.published import merged_card, report_summary
from mergekit_ram.stats.data import RamStatistics
from mergekit_ram.stats.schema import STATISTICS_FILE, statistics_to_json

LOG = logging.getLogger(__name__)


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


def run_merge(
    original: Callable[..., Any], merge_config: Any, out_path: str, options: Any, config_source: Optional[str] = None
) -> Any:
    """mergekit's ``run_merge``; a RAM merge checked, counted and staged around it (the module's sequence)."""
    if ours(merge_config.merge_method) is None:
        check_method_name(merge_config.merge_method)
        interrupts.merge_started()  # mergekit writes into OUT itself: its own Ctrl-C
        return original(merge_config, out_path, options=options, config_source=config_source)
    transaction = Transaction(out_path)
    with _reported(transaction):
        check_setting(options)
        refuse_input_folder(out_path, _model_folders(merge_config, options))
        headers, cache = HeaderCache(), CacheSettings.from_environment()
        check_config(merge_config, headers, options, config_source)
        with transaction.staged() as staged:
            plan = plan_merge(merge_config, options)
            config, session, statistics = prepare(merge_config, plan, options, headers, cache)
            source = config_source or merge_config.to_yaml()  # the recipe as given, not as run
            with bound(session):
                result = original(config, staged, options=options, config_source=source)
            if not os.path.isdir(staged):
                raise MergekitMovedError(
                    f"mergekit moved its output out of {staged} (an architecture with post_fill_parameters); "
                    "mergekit-ram cannot publish it"
                )
            finished = finish(staged, statistics(), options.write_model_card)
        if not options.quiet:
            report_summary(out_path, finished)
    return result


def plan_flat_merge(
    original: Callable[..., Any],
    config: Any,
    out_path: str,
    tensor_union: bool,
    tensor_intersection: bool,
    options: Any,
) -> list[Any]:
    """mergekit-pytorch's plan; a RAM merge is run here, whole, inside the output transaction (mergekit-pytorch
    then executes the empty plan returned)."""
    if ours(config.merge_method) is None:
        check_method_name(config.merge_method)
        interrupts.merge_started()  # mergekit writes into OUT itself: its own Ctrl-C
        return list(original(config, out_path, tensor_union, tensor_intersection, options))
    files = [entry.model for entry in config.models] + ([config.base_model] if config.base_model else [])
    transaction = Transaction(out_path)
    with _reported(transaction):
        check_setting(options)
        folders = [InputFolder(file, os.path.dirname(os.path.abspath(file)), False) for file in files]
        folders += [InputFolder(file, os.path.dirname(os.path.realpath(file)), False) for file in files]
        folders += [InputFolder(file, file) for file in files if os.path.isdir(file)]
        refuse_input_folder(out_path, folders)
        headers, cache = HeaderCache(), CacheSettings.from_environment()
        check_config(config, headers, options)
        with transaction.staged() as staged:
            planned = original(config, "", tensor_union, tensor_intersection, options)
            plan = Plan.of(config, planned)
            ram_config, session, statistics = prepare(config, plan, options, headers, cache)
            targets = original(ram_config, staged, tensor_union, tensor_intersection, options)
            with bound(session):
                executor(targets, options).execute()
            finished = finish(staged, statistics(), False)
        if not options.quiet:
            report_summary(out_path, finished)
    return []


@contextlib.contextmanager
def _reported(transaction: Transaction) -> Iterator[None]:
    """Ctrl-C as one line saying what the output folder holds; a resource failure as one line; a console
    script's later Ctrl-C as one line too (``interrupts``)."""
    console = interrupts.merge_started()
    try:
        yield
    except KeyboardInterrupt:
        raise transaction.interrupted() from None
    except Exception as error:
        found = reported(error, "merging")
        if found is None:
            raise
        LOG.info("traceback of the error reported below", exc_info=error)  # shown under -v
        if found is error:
            raise
        raise found from error
    if console:
        interrupts.merge_ended(transaction.interrupted().format_message())


def finish(staged: str, statistics: RamStatistics, card: bool) -> RamStatistics:
    """The merge's statistics, written beside the weights, and mergekit's card as the merge publishes it
    (``merged_card``: the ``--hub-id`` step makes it again), in the staging folder."""
    write_atomically(os.path.join(staged, STATISTICS_FILE), statistics_to_json(statistics))
    readme = Path(staged, "README.md")
    if card and readme.exists():
        readme.write_text(str(merged_card(readme.read_text(encoding="utf-8"), statistics)), encoding="utf-8")
    return statistics


def _model_folders(merge_config: Any, options: Any) -> Iterator[InputFolder]:
    """Each model reference's folders and ``--lora-merge-cache``."""
    for _, reference in model_references(merge_config):
        for path in (reference.model, reference.lora):
            if path is not None:
                yield InputFolder(str(reference), _local_folder(path.path, options))
        if reference.lora is not None and options.lora_merge_cache:
            yield InputFolder(str(reference), os.path.expanduser(options.lora_merge_cache))


def _local_folder(path: str, options: Any) -> str:
    """The folder mergekit reads for ``path``: itself if local, else its folder in the Hub cache."""
    local = os.path.expanduser(path)
    if os.path.exists(local):
        return local
    cache = options.transformers_cache or hub_constants.HF_HUB_CACHE
    return os.path.join(cache, "models--" + path.replace("/", "--"))
