"""What a command-line user sees: one-line errors (the traceback under -v), mergekit's own output for other
methods and for what mergekit does before it merges (reading the recipe file), the probe on multi-document
recipes, --plot and --cuda checked first, --version. The real console scripts' click commands run in this
process (``run_script``: what the console script prints, its exit status)."""

from __future__ import annotations

import ast
import json
import os
import pathlib
import shutil
import subprocess
import sys
import typing

import pytest
import torch
import yaml
from mergekit.config import MergeConfiguration
from mergekit.options import MergeOptions
from mergekit.scripts import merge_raw_pytorch, multimerge, run_yaml
from safetensors.torch import load_file, save_file

from mergekit_ram import checks, cli, errors
from mergekit_ram.errors import RecipeError
from mergekit_ram.probe import probe_config, select_stages
from tests.conftest import ModelSet, command_refusal, mergekit_alone, run_script, write_recipe
from tests.test_docs import package_modules
from tests.test_statistics import independent_figures

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message for a machine without CUDA")

#: Exceptions raised in the package that are not RamError, and why they never reach a command user.
INTERNAL_RAISES = {
    "ValueError": "kernel.py / settings.py invariants behind the recipe checks; integration/inmemory.py, "
    "synthetic.py (Python)",
    "NonFiniteInputError": "kernel.py; integration/methods.py re-raises it as InputError with model and tensor named",
    "click.ClickException": "cli.py: click prints it as one line itself",
    "click.BadParameter": "cli.py: click's usage error for an option's value (exit status 2), one Error line",
    "AttributeError": "__init__.py: the module attribute protocol",
    "MergekitMovedError": "a RamError (checked below through its class)",
    "MergeOverflowError": "kernel.py; integration/methods.py re-raises it as a ParameterError naming the tensor "
    "and the setting",
    "Interrupted": "signals.py: a signal as an exception inside the output transaction, re-sent once the folder "
    "is clean",
    "KeyboardInterrupt": "signals.py: SIGINT inside the output transaction, as Python's own handler raises it",
    "SystemExit": "signals.py: the exit status after a signal, as its default action would give; interrupts.py: "
    "130 after Ctrl-C",
    "transaction.interrupted": "integration/seam.py: Ctrl-C in a RAM merge as MergeInterrupted, a RamError the "
    "console scripts show as one line, exit status 130 (tests/test_interrupts.py)",
    "found": "errors.reported's RamError (or ResourceError) for an error, re-raised by the seam and the probe",
    "TypeError": "integration/inmemory.py: a wrong Python call shape (unexpected keyword arguments); "
    "integration/methods.py: mergekit's own check of in-memory groups",
    "UnreadableFile": "files.py: caught by its callers, which name the file (checks.py in an InputError, cache.py "
    "in a warning)",
}


def one_line_error(completed: subprocess.CompletedProcess) -> str:
    """The message of a failed command that reported its error as click does: one last line."""
    assert completed.returncode == 1, completed.stderr[-3000:]
    assert "Traceback" not in completed.stderr, completed.stderr[-3000:]
    lines = completed.stderr.strip().splitlines()
    assert [line for line in lines if line.startswith("Error:")] == [lines[-1]], completed.stderr[-3000:]
    return lines[-1].removeprefix("Error: ")


def with_traceback(completed: subprocess.CompletedProcess) -> str:
    """Under -v: the logged traceback, then the same one line."""
    assert completed.returncode == 1
    assert "traceback of the error reported below" in completed.stderr
    assert "Traceback (most recent call last)" in completed.stderr
    lines = completed.stderr.strip().splitlines()
    assert lines[-1].startswith("Error: ")
    return lines[-1].removeprefix("Error: ")


def without_plugin_frames(stderr: str) -> str:
    """A traceback without the frames of mergekit_ram's wrappers (present since the plugin's
    first patch of run_merge); the rest must be mergekit's output, unchanged."""
    kept, skipping = [], False
    for line in stderr.splitlines():
        if line.startswith('  File "'):
            skipping = f"{os.sep}mergekit_ram{os.sep}" in line
        elif not line.startswith("    "):
            skipping = False
        if not skipping:
            kept.append(line)
    return "\n".join(kept)


def test_every_error_a_user_can_meet_is_a_ram_error() -> None:
    """Each exception class raised in mergekit_ram is a RamError, or listed above with the reason."""
    raised = set()
    for module in package_modules():
        with open(os.path.join(ROOT, "mergekit_ram", module), encoding="utf-8") as handle:
            tree = ast.parse(handle.read())
        raised |= {
            ast.unparse(node.exc.func)
            for node in ast.walk(tree)
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)
        }
    from mergekit_ram.errors import InputError, MergekitMovedError
    from mergekit_ram.integration import internals, methods
    from mergekit_ram.parameters import ParameterError
    from mergekit_ram.staging import OutputBusyError, OutputFolderError

    classes = {cls.__name__: cls for cls in (InputError, ParameterError, MergekitMovedError, OutputBusyError)}
    classes["OutputFolderError"] = OutputFolderError
    from mergekit_ram.hub_ids import UnreadableNamingFile
    from mergekit_ram.stats.schema import UnreadableStatistics

    classes |= {"UnreadableNamingFile": UnreadableNamingFile, "UnreadableStatistics": UnreadableStatistics}
    classes["MergeInterrupted"] = errors.MergeInterrupted
    classes |= {name: getattr(errors, name) for name in dir(errors) if name.endswith("Error")}
    # ``raise make_error(...)``: functions that build an error; their return annotation must be a RamError
    factories = {
        "non_finite_error": methods.non_finite_error,
        "overflow_error": methods.overflow_error,
        "shape_error": checks.shape_error,
        "_moved": internals._moved,
    }
    for name, factory in factories.items():
        classes[name] = typing.get_type_hints(factory, localns=vars(errors))["return"]  # internals: TYPE_CHECKING
    unexplained = sorted(name for name in raised if name not in INTERNAL_RAISES and name not in classes)
    assert not unexplained, f"raised but neither a RamError nor explained as internal: {unexplained}"
    assert all(issubclass(cls, errors.RamError) for cls in classes.values())
    # Still the built-in classes callers catch today.
    assert issubclass(ParameterError, ValueError) and issubclass(InputError, ValueError)
    assert issubclass(MergekitMovedError, RuntimeError)


def test_plugin_errors_are_one_line_in_every_script(bf16_models: ModelSet, tmp_path) -> None:
    typo = write_recipe(str(tmp_path / "typo.yml"), bf16_models.recipe("ram_plus", parameters={"apha": 1.0}))
    expected = "ram_plus: unknown parameter 'apha' in parameters (did you mean 'alpha'?)"
    assert one_line_error(run_script("mergekit-yaml", typo, str(tmp_path / "o1"), check=False)).startswith(expected)

    missing = {**bf16_models.recipe("ram"), "name": "agents"}
    missing["models"] = [*missing["models"][:2], {"model": str(tmp_path / "no-such-agent")}]
    multi = write_recipe(str(tmp_path / "multi.yml"), missing)
    completed = run_script("mergekit-multi", multi, "-I", str(tmp_path / "stages" / "nested"), check=False)
    assert one_line_error(completed) == f"model path {tmp_path / 'no-such-agent'} does not exist"
    assert not os.path.exists(tmp_path / "stages" / "nested" / "agents")  # -I itself is mergekit-multi's

    # NaN in an input, found by the pre-pass of mergekit-pytorch; under -v the traceback comes first.
    broken = shutil.copytree(bf16_models.agents[1], str(tmp_path / "nan-agent"))
    weights = load_file(os.path.join(broken, "model.safetensors"))
    weights["model.layers.0.mlp.up_proj.weight"][0, 0] = float("nan")
    save_file(weights, os.path.join(broken, "model.safetensors"), metadata={"format": "pt"})
    raw = {
        "merge_method": "ram_plus",
        "base_model": os.path.join(bf16_models.base, "model.safetensors"),
        "models": [{"model": os.path.join(path, "model.safetensors")} for path in (bf16_models.agents[0], broken)],
    }
    raw_recipe = write_recipe(str(tmp_path / "raw.yml"), raw)
    completed = run_script("mergekit-pytorch", raw_recipe, str(tmp_path / "o3"), "-v", check=False)
    nan_file = os.path.join(broken, "model.safetensors")
    assert with_traceback(completed) == f"{nan_file}: tensor model.layers.0.mlp.up_proj.weight contains NaN or Inf"
    assert "raise non_finite_error(" in completed.stderr  # the plugin's own frame, shown under -v

    # An environment setting, through the fallback runner (which registers the plugin itself).
    recipe = write_recipe(str(tmp_path / "r.yml"), bf16_models.recipe("ram_plus"))
    bad_cache = {"MERGEKIT_RAM_CACHE": "sometimes"}
    completed = run_script("mergekit-ram", "yaml", recipe, str(tmp_path / "o4"), env=bad_cache, check=False)
    assert one_line_error(completed) == "MERGEKIT_RAM_CACHE must be on, off or refresh; got 'sometimes'"
    assert not any(os.path.exists(tmp_path / out) for out in ("o1", "o3", "o4"))


def test_reading_the_recipe_file_is_mergekits_and_the_probe_is_one_line(bf16_models: ModelSet, tmp_path) -> None:
    """What mergekit's scripts do before they merge (open the file, parse its YAML, validate it) they report as
    mergekit alone does; the probe, the plugin's own command, in one line naming the file and the place."""
    syntax = tmp_path / "syntax.yml"
    syntax.write_text(f"merge_method: ram_plus\nbase_model: [{bf16_models.base}\nmodels: 3\n", encoding="utf-8")
    missing = str(tmp_path / "no-such-recipe.yml")
    for arguments in ([str(syntax), str(tmp_path / "o")], [missing, str(tmp_path / "o")]):
        with_plugin = run_script("mergekit-yaml", *arguments, check=False)
        with mergekit_alone():
            alone = run_script("mergekit-yaml", *arguments, check=False)
        assert (with_plugin.returncode, with_plugin.stderr) == (alone.returncode, alone.stderr) != (0, "")
    message = one_line_error(run_script("mergekit-ram", "probe", str(syntax), check=False))
    assert message.startswith(f"{syntax}: invalid YAML at line 3, column 7: ")
    invalid = write_recipe(str(tmp_path / "invalid.yml"), {"name": "agents", "merge_method": "ram", "models": 3})
    message = one_line_error(run_script("mergekit-ram", "probe", invalid, check=False))
    assert message == f"{invalid}, document 1: not a valid mergekit recipe: models: Input should be a valid list"
    deep = tmp_path / "deep.yml"
    deep.write_text("merge_method: ram\nx: " + "[" * 20_000 + "]" * 20_000 + "\n", encoding="utf-8")
    assert one_line_error(run_script("mergekit-ram", "probe", str(deep), check=False)).startswith(
        f"{deep}: invalid YAML: a value cannot be read (RecursionError"
    )
    completed = run_script("mergekit-ram", "probe", missing, check=False)
    assert (completed.returncode, completed.stderr.splitlines()[-1]) == (
        2,
        f"Error: Invalid value for 'RECIPE': File '{missing}' does not exist.",
    )
    assert not os.path.exists(tmp_path / "o")


def test_a_misspelt_method_is_one_line_naming_the_method(bf16_models: ModelSet, tmp_path) -> None:
    """mergekit-yaml (what its user sees: one line, no traceback), mergekit-multi, mergekit-pytorch and the
    probe (their click commands here) name the method meant; another unknown name stays mergekit's error."""
    recipe = write_recipe(str(tmp_path / "r.yml"), bf16_models.recipe("ram_pluss"))
    expected = "unknown merge method 'ram_pluss' (did you mean 'ram_plus'?)"
    assert one_line_error(run_script("mergekit-yaml", recipe, str(tmp_path / "o"), check=False)) == expected
    assert command_refusal(cli.probe, recipe) == expected
    stages = write_recipe(str(tmp_path / "m.yml"), {"name": "agents", **bf16_models.recipe("RAM+")})
    refused = command_refusal(multimerge.main, stages, "-I", str(tmp_path / "stages"))
    assert refused == "unknown merge method 'RAM+' (did you mean 'ram_plus'?)"
    files = {"merge_method": "rma", "base_model": "base.safetensors", "models": [{"model": "a.safetensors"}]}
    raw = write_recipe(str(tmp_path / "raw.yml"), files)
    refused = command_refusal(merge_raw_pytorch.main, raw, str(tmp_path / "o"))
    assert refused == "unknown merge method 'rma' (did you mean 'ram'?)"
    for theirs in ("ties", "ramplus_tl"):  # mergekit's own methods, near ours: never taken for a misspelling
        probed = write_recipe(str(tmp_path / f"{theirs}.yml"), bf16_models.recipe(theirs))
        assert command_refusal(cli.probe, probed).startswith("probe reads mergekit-ram recipes")
    other = write_recipe(str(tmp_path / "other.yml"), bf16_models.recipe("frankenmerge"))
    with pytest.raises(RuntimeError, match="^Unimplemented merge method frankenmerge$"):
        run_yaml.main.main(args=[other, str(tmp_path / "o")], standalone_mode=False)
    assert not os.path.exists(tmp_path / "stages" / "agents")


@pytest.mark.parametrize(
    "case",
    ["yaml syntax", pytest.param("cuda", marks=NO_CUDA)],
)
def test_other_methods_keep_mergekit_output(bf16_models: ModelSet, tmp_path, case: str) -> None:
    """A linear recipe's failure prints what mergekit alone prints."""
    linear = {**bf16_models.recipe("linear"), "parameters": {"weight": 0.5}}
    if case == "yaml syntax":
        recipe = tmp_path / "linear.yml"
        recipe.write_text("merge_method: linear\nmodels: [{model: a}\n", encoding="utf-8")
        arguments = [str(recipe), str(tmp_path / "out")]
    else:
        arguments = [write_recipe(str(tmp_path / "linear.yml"), linear), str(tmp_path / "out"), "--cuda", "--quiet"]
    with_plugin = run_script("mergekit-yaml", *arguments, check=False)
    with mergekit_alone():
        without = run_script("mergekit-yaml", *arguments, check=False)
    assert with_plugin.returncode == without.returncode != 0
    assert "Traceback (most recent call last)" in with_plugin.stderr
    assert not with_plugin.stderr.strip().splitlines()[-1].startswith("Error:")
    assert without_plugin_frames(with_plugin.stderr) == without.stderr.rstrip("\n")


@NO_CUDA
def test_cuda_without_a_device_is_one_line(bf16_models: ModelSet, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    build, fix = (
        ("CPU build", "install a CUDA build of torch")
        if torch.version.cuda is None
        else (f"built for CUDA {torch.version.cuda}", "check the GPU's driver and CUDA_VISIBLE_DEVICES")
    )
    expected = (
        f"--cuda was given but no CUDA device is available (torch {torch.__version__}, {build}): "
        f"drop --cuda to run on the CPU, or {fix}"
    )
    recipe = write_recipe(str(tmp_path / "r.yml"), bf16_models.recipe("ram_plus"))
    assert one_line_error(run_script("mergekit-yaml", recipe, str(tmp_path / "o"), "--cuda", check=False)) == expected
    stages = write_recipe(str(tmp_path / "m.yml"), {"name": "agents", **bf16_models.recipe("ram")})
    completed = run_script("mergekit-multi", stages, "-I", str(tmp_path / "stages"), "--gpu-rich", check=False)
    assert one_line_error(completed) == expected.replace("--cuda", "--gpu-rich")
    # The probe checks before its cache can answer: counts cached by a probe in this process first.
    cached = {"MERGEKIT_RAM_CACHE": "on", "MERGEKIT_RAM_CACHE_DIR": str(tmp_path / "cache")}
    for variable, value in cached.items():
        monkeypatch.setenv(variable, value)
    probe_config(MergeConfiguration.model_validate(bf16_models.recipe("ram_plus")), MergeOptions(quiet=True))
    assert os.listdir(tmp_path / "cache") == ["prepass"] and len(os.listdir(tmp_path / "cache" / "prepass")) == 1
    completed = run_script("mergekit-ram", "probe", recipe, "--device", "cuda:0", "-v", check=False)
    assert with_traceback(completed) == expected.replace("--cuda", "--device cuda:0")
    assert not os.path.exists(tmp_path / "o")


#: How a recipe may ask for ram_plus: as spelt, or through a YAML merge key, inline or from an anchor (an alias).
METHOD_SPELLINGS = {
    "plain": "merge_method: ram_plus\n",
    "merge key": "<<: {merge_method: ram_plus}\n",
    "anchor": ".defaults: &defaults\n  merge_method: ram_plus\n<<: *defaults\n",
}


@NO_CUDA
@pytest.mark.parametrize(
    ("command", "spelling"),
    [
        ("mergekit-yaml", "merge key"),
        ("mergekit-yaml", "anchor"),
        ("mergekit-multi", "anchor"),
        ("mergekit-pytorch", "merge key"),
        ("mergekit-ram probe", "anchor"),
    ],
)
def test_a_method_given_through_a_merge_key_is_ours(
    bf16_models: ModelSet, tmp_path, command: str, spelling: str
) -> None:
    """``merge_method`` through a YAML merge key (``<<:``, inline or ``*defaults``): the seam sees the recipe as
    mergekit parsed it, so the one-line --cuda refusal the plain spelling gets, not mergekit's traceback."""
    recipe = bf16_models.recipe("ram_plus")
    del recipe["merge_method"]
    if command == "mergekit-pytorch":
        recipe = {
            "base_model": os.path.join(bf16_models.base, "model.safetensors"),
            "models": [{"model": os.path.join(path, "model.safetensors")} for path in bf16_models.agents],
        }
    if command == "mergekit-multi":
        recipe = {"name": "agents", **recipe}
    path = tmp_path / "recipe.yml"
    path.write_text(METHOD_SPELLINGS[spelling] + yaml.safe_dump(recipe, sort_keys=False), encoding="utf-8")
    name, *first = command.split()
    output = {"mergekit-multi": ["-I", str(tmp_path / "stages")], "mergekit-ram probe": []}
    arguments = [*first, str(path), *output.get(command, [str(tmp_path / "out")]), "--cuda"]
    message = one_line_error(run_script(name, *arguments, check=False))
    assert message.startswith("--cuda was given but no CUDA device is available")
    assert set(os.listdir(tmp_path)) <= {"recipe.yml", "stages"} and not os.path.exists(tmp_path / "stages/agents")


def test_probe_plot_extra_is_checked_first(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without matplotlib: one line naming the install, before the recipe is read."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as where it is not installed: its import fails
    recipe = write_recipe(
        str(tmp_path / "r.yml"), {"merge_method": "ram_plus", "base_model": "/nonexistent/base", "models": []}
    )
    completed = run_script("mergekit-ram", "probe", recipe, "--plot", str(tmp_path / "f.png"), check=False)
    assert one_line_error(completed) == (
        "--plot needs matplotlib, which is not installed here: pip install matplotlib "
        "(what the extra 'mergekit-ram[plot]' installs)"
    )


def test_version_names_mergekit_and_torch() -> None:
    import importlib.metadata

    completed = run_script("mergekit-ram", "--version")
    build = "CPU build" if torch.version.cuda is None else f"CUDA {torch.version.cuda} build"
    assert completed.stdout.splitlines() == [
        f"mergekit-ram {importlib.metadata.version('mergekit-ram')}",
        f"mergekit {importlib.metadata.version('mergekit')}",
        f"torch {importlib.metadata.version('torch')} ({build})",
    ]


def test_probe_reads_a_multi_document_recipe(bf16_models: ModelSet, tmp_path) -> None:
    """Every RAM stage of a mergekit-multi file; a stage built on an earlier one is named, not probed."""
    stages = [
        {"name": "agents", **bf16_models.recipe("ram_plus")},
        {"name": "pair", **bf16_models.recipe("ram"), "models": [{"model": p} for p in bf16_models.agents[:2]]},
        {
            "name": "after",
            **bf16_models.recipe("ram_plus"),
            "models": [{"model": "agents"}, {"model": bf16_models.agents[2]}],
        },
        {"merge_method": "linear", "models": [{"model": "after", "parameters": {"weight": 1.0}}]},
    ]
    config = tmp_path / "stages.multi.yml"
    config.write_text("# stages\n---\n" + yaml.safe_dump_all(stages, sort_keys=False), encoding="utf-8")
    completed = run_script("mergekit-ram", "probe", str(config), "--json")
    probe = json.loads(completed.stdout)
    assert list(probe["stages"]) == ["agents", "pair"]
    note = (
        "stage after cannot be probed yet: it merges the output of stage agents, which exists only once "
        "mergekit-multi has run that stage (then give the probe mergekit-multi's --intermediate-dir)"
    )
    assert probe["not_probed"] == [note]
    assert f"note: {note}" in completed.stderr.splitlines()
    expected = independent_figures(bf16_models)
    agents = probe["stages"]["agents"]
    assert agents["method"] == "ram_plus"
    assert [[m["overlap_histogram"][str(k)] for k in (1, 2, 3)] for m in agents["models"]] == expected["histograms"]
    pair = probe["stages"]["pair"]
    assert pair["method"] == "ram" and [m["model"] for m in pair["models"]] == bf16_models.agents[:2]

    with pytest.raises(RecipeError) as refused:
        select_stages(str(config), "after")
    assert str(refused.value) == note


@pytest.mark.parametrize("recipe", ["r-sweep.multi.yaml", "ram-plus-then-linear.multi.yaml"])
def test_probe_parses_the_repository_multi_recipes(recipe: str) -> None:
    """The repository's multi-document recipes (Hub models: only the parsing path runs here)."""
    path = os.path.join(ROOT, "recipes", "qwen2.5-7b", recipe)
    with open(path, encoding="utf-8") as handle:
        names = [doc.get("name", "(unnamed final stage)") for doc in yaml.safe_load_all(handle) if doc]
    with pytest.raises(RecipeError) as refused:
        select_stages(path, "no-such-stage")
    assert str(refused.value) == f"{path} has no stage named 'no-such-stage'; its stages: {', '.join(names)}"


def _demo_refusal(folder: str, reason: str) -> str:
    return (
        f"mergekit-ram demo writes only into a new or empty folder, or one it made: {folder} {reason}; "
        f"choose a new or empty folder, or remove {folder}"
    )


def _tree(folder: str) -> dict[str, bytes]:
    """Every entry under ``folder``: a file's bytes, a link's target, b"<folder>"."""
    found = {}
    for root, folders, files in os.walk(folder):
        for name in folders + files:
            path = os.path.join(root, name)
            relative = os.path.relpath(path, folder)
            if os.path.islink(path):
                found[relative] = b"-> " + os.readlink(path).encode()
            else:
                found[relative] = b"<folder>" if os.path.isdir(path) else pathlib.Path(path).read_bytes()
    return found


def test_demo_writes_only_into_a_folder_it_made(tmp_path) -> None:
    """A folder with a user's files (the names the demo writes, too) is refused untouched, also when it
    holds a marker that is a link; an empty folder is taken and marked, and a rerun into it works."""
    user = tmp_path / "user"
    (user / "models" / "base").mkdir(parents=True)
    (user / "recipe.yml").write_text("merge_method: ties\n", encoding="utf-8")
    (user / "models" / "overlap.json").write_text("{}\n", encoding="utf-8")
    (user / "models" / "base" / "config.json").write_text('{"mine": true}\n', encoding="utf-8")
    before = _tree(str(user))
    refused = run_script("mergekit-ram", "demo", str(user), check=False)
    assert one_line_error(refused) == _demo_refusal(str(user), "holds files and no .mergekit-ram-demo")
    assert _tree(str(user)) == before
    (tmp_path / "marker").write_text("made by mergekit-ram demo\n", encoding="utf-8")
    os.symlink(tmp_path / "marker", user / cli.DEMO_MARKER)
    before = _tree(str(user))
    refused = run_script("mergekit-ram", "demo", str(user), check=False)
    reason = "has a .mergekit-ram-demo the demo cannot trust (it is a symbolic link)"
    assert one_line_error(refused) == _demo_refusal(str(user), reason)
    assert _tree(str(user)) == before

    demo = tmp_path / "demo"
    demo.mkdir()
    for _ in range(2):  # as `make demo` does, into its own folder again
        completed = run_script("mergekit-ram", "demo", str(demo))
        assert f"Merged model: {demo / 'merged'}" in completed.stdout
    assert (demo / cli.DEMO_MARKER).is_file() and not (demo / cli.DEMO_MARKER).is_symlink()
    assert sorted(os.listdir(demo)) == [cli.DEMO_MARKER, "merged", "models", "recipe.yml"]


def test_the_probe_without_mergekit_is_one_line_with_the_pip_command(
    bf16_models: ModelSet, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``mergekit-ram probe`` where mergekit is not installed (its modules made unimportable here): the pip command
    in one line, not a 45-line ModuleNotFoundError (issue 45)."""
    recipe = write_recipe(str(tmp_path / "r.yml"), bf16_models.recipe("ram_plus"))
    for name in [name for name in sys.modules if name == "mergekit" or name.startswith("mergekit.")]:
        monkeypatch.setitem(sys.modules, name, None)
    assert one_line_error(run_script("mergekit-ram", "probe", recipe, check=False)) == (
        'mergekit-ram probe needs mergekit, which is not installed here: pip install "mergekit>=0.1.5,<0.2"'
    )
