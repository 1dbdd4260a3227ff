"""The mergekit names the plugin uses beyond mergekit's public method API (``mergekit.merge_methods``'s
``__all__``), in one table, and the mergekit releases it supports. A name that moved fails with one line
naming the version and the pip command, when a RAM merge first needs it.

Standard library only: the start-up hook checks mergekit's version (its metadata) with it before anything of
mergekit's but the package itself is imported, and the public names the plugin imports before a module that
imports them.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import re
from typing import TYPE_CHECKING, Any, NamedTuple, Optional

if TYPE_CHECKING:
    from mergekit_ram.errors import MergekitMovedError

#: The mergekit releases the test suite ran on, oldest first (CI: the oldest, and the newest pip installs).
TESTED_MERGEKIT = ("0.1.5",)
#: pyproject.toml's range for mergekit: the releases whose internals are expected where this table has them.
SUPPORTED_MERGEKIT = ">=0.1.5,<0.2"
_OLDEST, _BEYOND = (0, 1, 5), (0, 2)


class Internal(NamedTuple):
    """``name`` (dotted for a class's attribute) in ``module``; a replaced callable's expected ``parameters``; the
    ``attributes`` (fields) of a class's objects the plugin reads, duck-typed."""

    module: str
    name: str
    parameters: Optional[tuple[str, ...]] = None
    attributes: tuple[str, ...] = ()


#: What the plugin uses, and why (the boundary module in brackets).
INTERNALS = (
    # The seam (seam): run_merge, and mergekit-pytorch's planning entry with its recipe class.
    Internal("mergekit.merge", "run_merge", ("merge_config", "out_path", "options", "config_source")),
    Internal(
        "mergekit.scripts.merge_raw_pytorch",
        "plan_flat_merge",
        ("config", "out_path", "tensor_union", "tensor_intersection", "options"),
    ),  # fmt: skip
    # Registration (registration): the registry's table, to replace the built-in `ram` and bind one merge.
    Internal("mergekit.merge_methods.registry", "_METHODS"),
    # Planning as run_merge plans, and the pre-pass over the planned inputs (merge).
    Internal("mergekit.plan", "MergePlanner", attributes=("config", "arch_info", "out_model_config")),
    Internal("mergekit.architecture", "get_architecture_info"),
    Internal("mergekit.merge", "_model_out_config", ("config", "arch_info", "trust_remote_code")),
    Internal("mergekit.io.tasks", "LoaderCache"),
    Internal("mergekit.graph", "Executor"),
    # The planned task graph, read duck-typed (merge): what each output tensor merges, from which files.
    Internal("mergekit.io.tasks", "SaveTensor", attributes=("tensor_task",)),
    Internal(
        "mergekit.merge_methods.task_adapter",
        "ExecuteMergeMethodTask",
        attributes=("method_name", "gather_tensors", "model_order", "base_model", "output_weight", "parameters")
        + ("input_parameters", "dtype"),
    ),
    Internal("mergekit.io.tasks", "GatherTensors", attributes=("weight_info",)),
    Internal("mergekit.tokenizer.embed", "PermutedVocabulary", attributes=("gather_tensors",)),
    Internal("mergekit.tokenizer.truncate", "TruncatedVocabulary", attributes=("gather_tensors",)),
    Internal("mergekit.merge_methods.task_adapter", "TensorDictWrapper", attributes=("tensors",)),
    Internal("mergekit.scripts.merge_raw_pytorch", "SimpleLoadTensor", attributes=("model", "tensor_name")),
    Internal(
        "mergekit.architecture.base",
        "WeightInfo",
        attributes=("name", "optional", "vocabulary_axis", "aliases", "tied_names"),
    ),
    Internal("mergekit.io.lazy_tensor_loader", "LazyTensorLoader", attributes=("index",)),
    Internal("mergekit.io.lazy_tensor_loader", "ShardedTensorIndex", attributes=("base_path", "tensor_paths")),
    # Recipes (recipes): architectures mergekit knows; the recipe's and the options' fields the checks read; the
    # probe's options and mergekit-multi's stages (probe).
    Internal("mergekit.architecture.json_definitions", "NAME_TO_ARCH"),
    Internal(
        "mergekit.config",
        "MergeConfiguration",
        attributes=("merge_method", "base_model", "models", "modules", "out_dtype", "tokenizer_source", "tokenizer")
        + ("referenced_models", "to_yaml"),
    ),
    Internal("mergekit.common", "ModelReference", attributes=("model", "lora", "override_architecture")),
    Internal("mergekit.common", "ModelPath", attributes=("path", "revision")),
    Internal(
        "mergekit.options",
        "MergeOptions",
        attributes=("allow_crimes", "cuda", "device", "lora_merge_cache", "low_cpu_memory", "num_threads", "quiet")
        + ("transformers_cache", "trust_remote_code", "write_model_card"),
    ),
    Internal("mergekit.scripts.multimerge", "patched_config"),
    # The card run_merge writes, made again for the --hub-id step (card).
    Internal("mergekit.card", "generate_card", ("config", "config_yaml", "name")),
)
_ENTRIES = {(entry.module, entry.name): entry for entry in INTERNALS}
#: The names of the public method API (``mergekit.merge_methods``) the boundary imports: all there, or the plugin
#: stays off (a module importing one would fail with a traceback).
PUBLIC_API = (
    "BasePolicy",
    "InputContract",
    "MergeMethod",
    "PerNonBase",
    "TensorGroup",
    "get",
    "merge_method",
    "merge_state_dicts",
    "ram_merge",
    "register",
    "registered_methods",
)
#: The plugin's methods (``parameters.METHOD_NAMES``, which imports pydantic).
PLUGIN_METHODS = ("ram", "ram_plus", "ram_ties", "ram_unique")


def mergekit_version() -> str:
    """The installed distribution's version (mergekit has no ``__version__``)."""
    try:
        return importlib.metadata.version("mergekit")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def install_command() -> str:
    """pip installing the newest tested mergekit, over a build calling itself that version too."""
    tested = TESTED_MERGEKIT[-1]
    force = " --force-reinstall --no-deps" if mergekit_version() == tested else ""
    return f'pip install{force} "mergekit=={tested}"'


def _release(version: str) -> tuple[int, ...]:
    """The leading numbers of a version: 0.1.5.dev1 -> (0, 1, 5); () where there are none."""
    found = re.match(r"\d+(?:\.\d+)*", version)
    return tuple(int(part) for part in found[0].split(".")) if found else ()


def version_refusal() -> Optional[str]:
    """Why the four methods refuse to merge with the installed mergekit (one line with the pip command);
    None where its version is in ``SUPPORTED_MERGEKIT``."""
    version = mergekit_version()
    if _OLDEST <= _release(version) < _BEYOND:
        return None
    return f"mergekit-ram supports mergekit{SUPPORTED_MERGEKIT}, not {version}: {install_command()}"


def unsupported() -> Optional[str]:
    """Why the plugin cannot run with the installed mergekit (one line with the pip command), or None: its
    version first (metadata only), then, only for a version in the range, the public names the plugin imports."""
    refusal = version_refusal()
    if refusal is not None:
        return refusal
    methods = importlib.import_module("mergekit.merge_methods")
    missing = [name for name in PUBLIC_API if not hasattr(methods, name)]
    return _moved(f"mergekit.merge_methods.{missing[0]}").format_message() if missing else None


def refuse_method(method: str, refusal: str) -> None:
    """A recipe naming one of the plugin's methods, where the plugin is off (``refusal``): refused with it. The
    one exception is ``ram`` where that mergekit has its own (0.1.5 and later; 0.1.4 has none): mergekit's runs."""
    if method in PLUGIN_METHODS and not (method == "ram" and _mergekits_own(method)):
        from mergekit_ram.errors import MergekitMovedError

        raise MergekitMovedError(refusal)


def _mergekits_own(method: str) -> bool:
    """Whether mergekit has a method ``method`` of its own registered (not one of mergekit-ram's)."""
    try:
        found = importlib.import_module("mergekit.merge_methods").get(method)
    except Exception:  # mergekit's refusal of an unknown name (a RuntimeError in 0.1.4 and 0.1.5)
        return False
    function = getattr(getattr(found, "implementation", None), "func", None)  # a mergekit-ram method's partial
    return not getattr(function, "__module__", "").startswith("mergekit_ram.")


def internal(module: str, name: str) -> Any:
    """The ``INTERNALS`` entry ``module.name``, checked to exist (and take the parameters expected)."""
    entry = _ENTRIES[(module, name)]
    try:
        value: Any = importlib.import_module(module)
    except ImportError as error:
        if error.name == "mergekit":  # mergekit itself missing: its own ImportError
            raise
        raise _moved(module) from None
    for part in name.split("."):
        if not hasattr(value, part):
            raise _moved(f"{module}.{name}")
        value = getattr(value, part)
    if entry.parameters is not None:
        found = tuple(inspect.signature(inspect.unwrap(value)).parameters)
        if found != entry.parameters:
            raise _moved(f"{module}.{name}", f" with the parameters {', '.join(entry.parameters)}")
    fields = {*getattr(value, "model_fields", ()), *getattr(value, "__dataclass_fields__", ())}
    fields |= set(getattr(value, "__annotations__", {}))
    if missing := [
        attribute for attribute in entry.attributes if attribute not in fields and not hasattr(value, attribute)
    ]:
        raise _moved(f"{module}.{name}", f" with the attributes {', '.join(missing)}")
    return value


def _moved(what: str, detail: str = "") -> MergekitMovedError:
    from mergekit_ram.errors import MergekitMovedError

    return MergekitMovedError(
        f"mergekit-ram cannot find {what}{detail} in mergekit {mergekit_version()}; it supports "
        f"mergekit{SUPPORTED_MERGEKIT} where that is unchanged (tested: {', '.join(TESTED_MERGEKIT)}): "
        f"{install_command()}"
    )
