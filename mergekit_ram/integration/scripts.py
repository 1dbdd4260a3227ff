"""mergekit's console scripts for RAM recipes: one-line errors, the CUDA check, unknown keys (of each
mergekit-multi stage), stages writing into an input."""

from __future__ import annotations

import os
from types import ModuleType
from typing import Any, Callable, Optional

from mergekit_ram.device import check_device
from mergekit_ram.errors import RamError, RecipeError, exit_if_reported
from mergekit_ram.files import removed_if_failed
from mergekit_ram.integration.internals import internal, wrap
from mergekit_ram.integration.output import RawPyTorchMergeConfig, raw_pytorch_merge, refuse_stage_outputs
from mergekit_ram.integration.recipes import check_method_name, check_stage_keys, read_stages
from mergekit_ram.integration.registry import is_ours
from mergekit_ram.interrupts import exit_interrupted, merge_started
from mergekit_ram.recipe_file import declared_methods, read_documents, read_text, validate

#: mergekit's console scripts by click command name: (the command as installed, its recipe file argument)
SCRIPTS = {
    "mergekit-yaml": ("mergekit-yaml", "config_file"),
    "mergekit-multimerge": ("mergekit-multi", "config_file"),
    "mergekit-pytorch": ("mergekit-pytorch", "config_path"),
}
MergeConfiguration: Any = internal("mergekit.config", "MergeConfiguration")
MergeOptions: Any = internal("mergekit.options", "MergeOptions")


def patch_scripts(options: ModuleType) -> None:
    """Through the scripts' shared click class: errors as one line (a ``RamError`` always, others for a RAM recipe
    only), a failed RAM ``mergekit-multi``'s empty ``-I`` folder removed, Ctrl-C in a RAM merge one line (exit 130)."""

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def invoke(command: Any, context: Any) -> Any:
            if command.name not in SCRIPTS:
                return original(command, context)
            merge_started()
            name, recipe_argument = SCRIPTS[command.name]
            kwargs = context.params
            checked, theirs = None, False
            try:
                checked = check_script_recipe(name, kwargs.get(recipe_argument), kwargs)
                theirs = checked is None  # mergekit's own recipe: mergekit's own Ctrl-C
                if name == "mergekit-pytorch" and checked is not None:
                    raw_pytorch_merge(kwargs, *checked)  # its options are built inside the command
                    return None
                with removed_if_failed(kwargs.get("intermediate_dir") if checked is not None else None):
                    return original(command, context)  # mergekit-multi makes its -I folder itself
            except KeyboardInterrupt as interrupt:
                if not theirs:
                    exit_interrupted(interrupt, kwargs.get("out_path") or kwargs.get("intermediate_dir"))
                raise
            except Exception as error:
                if checked is not None or isinstance(error, RamError):
                    exit_if_reported(error, bool(kwargs.get("verbosity")), "merging")
                raise

        return invoke

    wrap("mergekit.options", "PrettyPrintHelp.invoke", make)


def check_script_recipe(
    name: str, path: Optional[str], arguments: dict[str, Any]
) -> Optional[tuple[MergeOptions, str]]:
    """A RAM recipe file (a misspelt method refused) read and validated as ``name`` will, the device and
    mergekit-multi's stage outputs checked: the command's MergeOptions and the text checked; None for any other file."""
    if path is None:
        return None
    if not os.path.exists(path):  # mergekit-yaml's own open() would raise a traceback
        raise RecipeError(f"recipe file {path} does not exist")
    text = read_text(path)
    methods = declared_methods(text) if text is not None else []
    for method in methods:
        check_method_name(method)
    if text is None or not any(is_ours(method) for method in methods):
        return None
    stages = []
    if name == "mergekit-multi":
        stages = read_stages(path, text, arguments.get("intermediate_dir") or "")
    else:
        documents = read_documents(path, text)
        if len(documents) != 1:
            raise RecipeError(
                f"{path} holds {len(documents)} YAML documents; {name} reads one recipe "
                "(a file of named stages separated by '---' is for mergekit-multi)"
            )
        validate(path, documents[0], RawPyTorchMergeConfig if name == "mergekit-pytorch" else MergeConfiguration)
    options = MergeOptions(**{key: value for key, value in arguments.items() if key in MergeOptions.model_fields})
    check_options_device(options)
    if stages:
        refuse_stage_outputs(stages, arguments.get("intermediate_dir") or "", arguments.get("out_path"), options)
        check_stage_keys(path, text)
    return options, text


def check_options_device(options: MergeOptions) -> None:
    """The CUDA device ``options`` ask for exists."""
    device = str(options.device or "cpu")
    flag = "--gpu-rich" if options.gpu_rich else "--cuda" if options.cuda else f"--device {device}"
    check_device(device, flag)
