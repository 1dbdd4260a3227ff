"""mergekit's console scripts (``mergekit-yaml``, ``mergekit-multi``, ``mergekit-pytorch``) for RAM recipes:
one-line errors, the CUDA check, unknown keys of mergekit-multi's stages, stages writing into an input,
the statistics table."""

from __future__ import annotations

import os
from types import ModuleType
from typing import Any, Callable, Optional

import yaml

from mergekit_ram.device import check_device
from mergekit_ram.errors import RamError, RecipeError, exit_if_reported
from mergekit_ram.files import removed_if_failed
from mergekit_ram.integration.internals import internal, wrap
from mergekit_ram.integration.output import refuse_stage_outputs
from mergekit_ram.integration.recipes import check_method_name, check_raw_keys, read_stages
from mergekit_ram.integration.registry import is_ours
from mergekit_ram.interrupts import exit_interrupted, merge_started
from mergekit_ram.recipe_file import declared_methods, read_single_document, read_text, validate

#: mergekit's console scripts: module -> (command name, the argument that names the recipe file)
SCRIPTS = {
    "mergekit.scripts.run_yaml": ("mergekit-yaml", "config_file"),
    "mergekit.scripts.multimerge": ("mergekit-multi", "config_file"),
    "mergekit.scripts.merge_raw_pytorch": ("mergekit-pytorch", "config_path"),
}
_CLI_MARK = "__mergekit_ram_cli__"
MergeConfiguration: Any = internal("mergekit.config", "MergeConfiguration")
MergeOptions: Any = internal("mergekit.options", "MergeOptions")


def patch_script(script: ModuleType) -> None:
    """The plugin's errors as one line (``Error: ...``, exit 1; the traceback with ``-v``).

    The plugin's own errors are told by type (``RamError``). A YAML or schema error, a
    missing CUDA device and a resource failure (``errors.resource_message``: too many open files,
    a full disk) are reported so only for a file that asks for one of this plugin's methods,
    and a misspelling of their names for any file: for every other recipe mergekit's output stays
    as it was. ``mergekit-pytorch`` (which has no ``run_merge``) also shows the statistics table here.
    A failed ``mergekit-multi`` run of a RAM recipe removes the ``-I`` folder it made, if empty
    (the failed stage has removed its own folder). Ctrl-C, but during a merge of another method, is one line
    saying what the output folder holds and exit status 130 (``mergekit_ram.interrupts``).
    """
    name, recipe_argument = SCRIPTS[script.__name__]

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def callback(*args: Any, **kwargs: Any) -> Any:
            merge_started()
            options, theirs = None, False
            try:
                options = check_script_recipe(script, name, kwargs.get(recipe_argument), kwargs)
                theirs = options is None  # mergekit's own recipe: mergekit's own Ctrl-C
                with removed_if_failed(kwargs.get("intermediate_dir") if options is not None else None):
                    result = original(*args, **kwargs)  # mergekit-multi makes its -I folder itself
            except KeyboardInterrupt as interrupt:
                if not theirs:
                    exit_interrupted(interrupt, kwargs.get("out_path") or kwargs.get("intermediate_dir"))
                raise
            except Exception as error:
                if options is not None or isinstance(error, RamError):
                    exit_if_reported(error, bool(kwargs.get("verbosity")), "merging")
                raise
            return result

        return callback

    wrap(script.__name__, "main.callback", make, mark=_CLI_MARK)


def check_script_recipe(
    script: ModuleType, name: str, path: Optional[str], arguments: dict[str, Any]
) -> Optional[MergeOptions]:
    """For a recipe file that asks for a RAM method (its ``merge_method``, or a misspelling of one, which is
    refused here): read and validate it as ``name`` will, check the device and (``mergekit-multi``) that
    no RAM stage writes into a folder a stage reads, and return the command's MergeOptions; None for
    any other file."""
    if path is not None and not os.path.exists(path):  # mergekit-yaml's own open() would raise a traceback
        raise RecipeError(f"recipe file {path} does not exist")
    text = read_text(path) if path else None
    methods = declared_methods(text) if path is not None and text is not None else []
    for method in methods:
        check_method_name(method)
    if path is None or text is None or not any(is_ours(method) for method in methods):
        return None
    stages = []
    if name == "mergekit-multi":
        stages = read_stages(path, text, arguments.get("intermediate_dir") or "")
    else:
        schema = (
            internal("mergekit.scripts.merge_raw_pytorch", "RawPyTorchMergeConfig")
            if name == "mergekit-pytorch"
            else MergeConfiguration
        )
        validate(path, read_single_document(path, text, name), schema)
    options = merge_options(**{key: value for key, value in arguments.items() if key in MergeOptions.model_fields})
    check_options_device(options)
    if stages:
        refuse_stage_outputs(stages, arguments.get("intermediate_dir") or "", arguments.get("out_path"), options)
    return options


def merge_options(**arguments: Any) -> MergeOptions:
    """mergekit's options from command-line arguments (its own validation applies)."""
    return MergeOptions(**arguments)


def check_options_device(options: MergeOptions) -> None:
    """The CUDA device ``options`` ask for (``--cuda``, ``--gpu-rich``, ``--device cuda...``) exists."""
    device = str(options.device or "cpu")
    flag = "--gpu-rich" if options.gpu_rich else "--cuda" if options.cuda else f"--device {device}"
    check_device(device, flag)


def patch_multimerge(multimerge: ModuleType) -> None:
    """``mergekit-multi`` validates each stage of its file and rebuilds it without the keys it
    dropped; check the raw stages of RAM recipes for unknown keys first."""

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def load_config(config_source: str, intermediate_dir: str) -> Any:
            for document in yaml.safe_load_all(config_source):
                if isinstance(document, dict):
                    stage = {key: value for key, value in document.items() if key != "name"}
                    check_raw_keys(stage, MergeConfiguration)
            return original(config_source, intermediate_dir)

        return load_config

    wrap("mergekit.scripts.multimerge", "load_config", make)
