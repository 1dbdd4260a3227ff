"""A mergekit the plugin does not support: outside the supported range, or in it without a name of the method API
the plugin imports, the plugin is off (one short line, once, when mergekit is imported; nothing registered), its
methods refuse in one line with the pip command, other methods run as mergekit alone; an internal moved within
the range is named in one line when a RAM merge needs it.

The "moved" mergekit is the installed one copied into a temporary folder, its version bumped where mergekit
keeps it (the distribution's metadata: mergekit has no ``__version__``; and the version its ``tensor_writer``
writes into an index), put first on ``PYTHONPATH`` of the real console scripts, as a source build kept beside
the plugin would be. The old one is the real mergekit 0.1.4 from the package index, in an environment of its own
(``old_mergekit``). The in-process tests stand the installed mergekit in for them.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import mergekit
import mergekit.merge
import mergekit.merge_methods
import pytest

from mergekit_ram._autoload import SAID
from mergekit_ram.integration import internals, register
from tests.conftest import (
    Merged,
    ModelSet,
    built_once,
    load_weights,
    mergekit_alone,
    plugin_log,
    run_process,
    run_script,
    script,
    write_recipe,
)

VERSION = "0.2.0"
REFUSAL = f'mergekit-ram supports mergekit>=0.1.5,<0.2, not {VERSION}: pip install "mergekit==0.1.5"'
#: Logged while mergekit is imported, before any logging is set up: Python's last-resort handler prints it as is.
WARNING = f"{REFUSAL}; its methods are off"
ROOT = Path(__file__).resolve().parents[1]
#: The real old mergekit, and what it needs that differs from this environment's packages (everything else comes
#: from them): 0.1.4 pins pydantic~=2.10.6 (its recipe classes do not build with 2.14) and plans only with
#: transformers 4 (transformers 5's PretrainedConfig is not a type its pydantic classes accept), which needs
#: huggingface_hub below 1.0 and tokenizers up to 0.23.0.
OLD_MERGEKIT = (
    "mergekit==0.1.4",
    "pydantic==2.10.6",
    "pydantic-core==2.27.2",
    "transformers==4.57.6",
    "huggingface-hub==0.36.2",
    "tokenizers==0.22.2",
)
OLD_REFUSAL = 'mergekit-ram supports mergekit>=0.1.5,<0.2, not 0.1.4: pip install "mergekit==0.1.5"'
#: What pip prints when it cannot reach the package index (the one reason the old-mergekit test is skipped).
UNREACHABLE = ("Failed to establish a new connection", "Temporary failure in name resolution", "(from versions: none)")


def build_moved_mergekit(root: Path) -> str:
    """The installed mergekit copied under ``root``, its version ``VERSION``: the folder to put on PYTHONPATH."""
    spec = importlib.util.find_spec("mergekit")
    assert spec is not None and spec.submodule_search_locations
    package = root / "mergekit"
    shutil.copytree(spec.submodule_search_locations[0], package, ignore=shutil.ignore_patterns("__pycache__"))
    writer = package / "io" / "tensor_writer.py"  # the version it writes into an index's metadata
    written = f'"mergekit_version": "{importlib.metadata.version("mergekit")}"'
    writer.write_text(writer.read_text(encoding="utf-8").replace(written, f'"mergekit_version": "{VERSION}"'), "utf-8")
    info = root / f"mergekit-{VERSION}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: mergekit\nVersion: {VERSION}\n", encoding="utf-8")
    return str(root)


def build_old_mergekit(folder: str) -> str:
    """A virtual environment with ``OLD_MERGEKIT`` from the package index in front of this environment's packages
    (a ``.pth`` line naming them, read before the plugin's own), and the plugin installed into it with
    ``--no-deps``, as a user with that mergekit would: the folder of its scripts. Skips the test only where the
    package index cannot be reached."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", folder], check=True, capture_output=True)
    site = Path(sysconfig.get_path("purelib", vars={"base": folder, "platbase": folder}))
    (site / "00-this-environment.pth").write_text(sysconfig.get_path("purelib") + "\n", encoding="utf-8")
    pip = [os.path.join(folder, "bin", "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    fetched = subprocess.run(
        [*pip, "--no-deps", "--retries", "1", "--timeout", "30", *OLD_MERGEKIT], capture_output=True, text=True
    )
    output = fetched.stdout + fetched.stderr
    if fetched.returncode != 0 and any(sign in output for sign in UNREACHABLE):
        pytest.skip(f"the package index cannot be reached to install mergekit 0.1.4: {output.strip()[-300:]}")
    assert fetched.returncode == 0, output
    installed = subprocess.run([*pip, "--no-deps", "--no-build-isolation", str(ROOT)], capture_output=True, text=True)
    assert installed.returncode == 0, installed.stdout + installed.stderr
    return os.path.join(folder, "bin")


@pytest.fixture(scope="session")
def old_mergekit(run_root: Path) -> str:
    return built_once(run_root, "mergekit-0.1.4", build_old_mergekit)


@pytest.mark.process
def test_outside_the_range_one_warning_and_the_methods_refuse(bf16_models: ModelSet, tmp_path) -> None:
    """The real console script on a mergekit 0.2.0: one short warning line once, a RAM recipe refused in one
    line with the pip command and nothing written; a linear recipe writes what mergekit alone writes."""
    moved = build_moved_mergekit(tmp_path / "moved")
    env = {"PYTHONPATH": moved, "MERGEKIT_RAM_AUTOLOAD": "1"}
    out = tmp_path / "out"
    refused = run_process(
        [script("mergekit-yaml"), write_recipe(str(tmp_path / "r.yml"), bf16_models.recipe("ram_plus")), str(out)], env
    )
    assert (refused.returncode, refused.stderr.splitlines()) == (1, [f"warning: {WARNING}", f"Error: {REFUSAL}"])
    assert len(WARNING) <= 120 and not out.exists()
    recipe = {
        "merge_method": "linear",
        "models": [{"model": path, "parameters": {"weight": 1.0}} for path in [bf16_models.base, *bf16_models.agents]],
        "dtype": "bfloat16",
    }
    path = write_recipe(str(tmp_path / "linear.yml"), recipe)
    aside, alone = tmp_path / "aside" / "out", tmp_path / "alone" / "out"  # one name: the card's title
    completed = run_process([script("mergekit-yaml"), path, str(aside), "--no-copy-tokenizer"], env)
    assert completed.returncode == 0 and completed.stderr.count("mergekit-ram") == 1, completed.stderr
    with mergekit_alone():
        run_script("mergekit-yaml", path, str(alone), "--no-copy-tokenizer")
    assert sorted(os.listdir(aside)) == sorted(os.listdir(alone)) == [
        "README.md", "config.json", "mergekit_config.yml", "model.safetensors"
    ]  # fmt: skip
    for name in ("config.json", "mergekit_config.yml", "model.safetensors"):
        assert (aside / name).read_bytes() == (alone / name).read_bytes(), name
    card, card_alone = ((folder / "README.md").read_text(encoding="utf-8") for folder in (aside, alone))
    assert sorted(card.splitlines()) == sorted(card_alone.splitlines())  # mergekit lists the models from a set
    assert load_weights(str(aside))


def test_every_way_to_merge_refuses_in_one_line(bf16_models: ModelSet, tmp_path, monkeypatch) -> None:
    """mergekit-yaml, mergekit-multi, mergekit-pytorch, ``mergekit-ram yaml`` and the probe: the refusal, and
    nothing created (this process's mergekit taken for a 0.2.0)."""
    monkeypatch.setattr(internals, "mergekit_version", lambda: VERSION)
    recipe = write_recipe(str(tmp_path / "r.yml"), bf16_models.recipe("ram"))
    stages = write_recipe(str(tmp_path / "multi.yml"), {"name": "agents", **bf16_models.recipe("ram_ties")})
    raw = {
        "merge_method": "ram_unique",
        "base_model": os.path.join(bf16_models.base, "model.safetensors"),
        "models": [{"model": os.path.join(path, "model.safetensors")} for path in bf16_models.agents],
    }
    runs = [
        ("mergekit-yaml", recipe, str(tmp_path / "out")),
        ("mergekit-ram", "yaml", recipe, str(tmp_path / "out")),
        ("mergekit-multi", stages, "-I", str(tmp_path / "stages"), "--out-path", str(tmp_path / "out")),
        ("mergekit-pytorch", write_recipe(str(tmp_path / "raw.yml"), raw), str(tmp_path / "raw")),
        ("mergekit-ram", "probe", recipe),
    ]
    for name, *args in runs:
        completed = run_script(name, *args, check=False)
        assert (completed.returncode, completed.stderr.splitlines()[-1:]) == (1, [f"Error: {REFUSAL}"]), args
    assert not any(os.path.exists(tmp_path / name) for name in ("out", "raw", "stages/agents"))


def test_an_internal_moved_within_the_range_is_named(bf16_models: ModelSet, tmp_path, monkeypatch) -> None:
    """A release in the range that renamed a helper the pre-pass plans with: the merge that needs it refuses in
    one line naming it and the pip command; nothing is written."""
    monkeypatch.delattr(mergekit.merge, "_model_out_config")
    out = tmp_path / "out"
    completed = run_script(
        "mergekit-yaml", write_recipe(str(tmp_path / "r.yml"), bf16_models.recipe("ram_plus")), str(out), check=False
    )
    version = importlib.metadata.version("mergekit")
    force = " --force-reinstall --no-deps" if version == "0.1.5" else ""
    assert (completed.returncode, completed.stderr.splitlines()[-1:]) == (
        1,
        [
            f"Error: mergekit-ram cannot find mergekit.merge._model_out_config in mergekit {version}; it supports "
            f'mergekit>=0.1.5,<0.2 where that is unchanged (tested: 0.1.5): pip install{force} "mergekit==0.1.5"'
        ],
    )
    assert not out.exists()


@pytest.mark.process
def test_the_real_mergekit_0_1_4_runs_as_alone(old_mergekit: str, bf16_models: ModelSet, tmp_path) -> None:
    """mergekit 0.1.4 (no built-in ``ram``) with the plugin installed beside it: importing mergekit prints the one
    line and nothing else; task_arithmetic through its mergekit-yaml writes what it writes with the plugin off and
    prints nothing more but that line; ram_plus and ram through mergekit-yaml, and the probe, fail in one line
    with the pip command (after the line of mergekit's import, where the command imports mergekit)."""
    old = functools.partial(os.path.join, old_mergekit)
    warning = f"{OLD_REFUSAL}; its methods are off"
    on = {"MERGEKIT_RAM_AUTOLOAD": "1"}
    code = "import mergekit, importlib.metadata as m; print(m.version('mergekit'))"
    imported = run_process([old("python"), "-c", code], on)
    assert (imported.returncode, imported.stdout, imported.stderr) == (0, "0.1.4\n", f"{warning}\n")
    recipe = bf16_models.recipe("task_arithmetic", dtype="bfloat16")
    for entry in recipe["models"]:
        entry["parameters"] = {"weight": 0.5}
    path = write_recipe(str(tmp_path / "task_arithmetic.yml"), recipe)
    outs, stderr = {}, {}
    for autoload in ("1", "0"):  # one folder name: the card's title
        outs[autoload] = tmp_path / f"autoload-{autoload}" / "out"
        command = [old("mergekit-yaml"), path, str(outs[autoload]), "--no-copy-tokenizer", "--quiet"]
        completed = run_process(command, {"MERGEKIT_RAM_AUTOLOAD": autoload})
        assert completed.returncode == 0, completed.stderr[-3000:]
        stderr[autoload] = completed.stderr
    assert stderr["1"] == f"warning: {warning}\n{stderr['0']}" and "Traceback" not in stderr["1"]
    files = sorted(os.listdir(outs["1"]))
    assert files == sorted(os.listdir(outs["0"])) and "model.safetensors" in files
    for name in files:
        mine, alone = ((outs[key] / name).read_text(encoding="utf-8", errors="replace") for key in ("1", "0"))
        if name == "README.md":  # mergekit lists the models from a set
            mine, alone = sorted(mine.splitlines()), sorted(alone.splitlines())
        assert mine == alone and (outs["1"] / name).stat().st_size == (outs["0"] / name).stat().st_size, name
    assert (outs["1"] / "model.safetensors").read_bytes() == (outs["0"] / "model.safetensors").read_bytes()
    for method in ("ram_plus", "ram"):
        out = tmp_path / method
        recipe_path = write_recipe(str(tmp_path / f"{method}.yml"), bf16_models.recipe(method))
        refused = run_process([old("mergekit-yaml"), recipe_path, str(out)], on)
        assert (refused.returncode, refused.stderr.splitlines()) == (
            1,
            [f"warning: {warning}", f"Error: {OLD_REFUSAL}"],
        ), method
        assert not out.exists()
    probed = run_process([old("mergekit-ram"), "probe", str(tmp_path / "ram_plus.yml")], on)
    assert (probed.returncode, probed.stdout, probed.stderr) == (1, "", f"Error: {OLD_REFUSAL}\n")


def test_a_missing_name_of_the_method_api_turns_the_plugin_off(
    builtin_ram_merge: Merged, bf16_models: ModelSet, tmp_path, monkeypatch
) -> None:
    """A release in the range without a name of the method API the plugin imports (``BasePolicy``): one line,
    once, and nothing registered; a RAM recipe refused in one line with the pip command, nothing written; ``ram``
    is mergekit's own, merged as mergekit alone merges it (this process's mergekit stands in for that release)."""
    from mergekit.merge_methods import ram_merge
    from mergekit.merge_methods.registry import _METHODS

    monkeypatch.delattr(mergekit.merge_methods, "BasePolicy")
    monkeypatch.setattr(mergekit, SAID, False, raising=False)  # the line not yet said in this process
    for name in ("ram_plus", "ram_ties", "ram_unique"):
        monkeypatch.delitem(_METHODS, name)
    monkeypatch.setitem(_METHODS, "ram", ram_merge)  # as mergekit alone has it: the plugin registered nothing
    version = importlib.metadata.version("mergekit")
    force = " --force-reinstall --no-deps" if version == "0.1.5" else ""
    moved = (
        f"mergekit-ram cannot find mergekit.merge_methods.BasePolicy in mergekit {version}; it supports "
        f'mergekit>=0.1.5,<0.2 where that is unchanged (tested: 0.1.5): pip install{force} "mergekit==0.1.5"'
    )
    with plugin_log(logging.WARNING) as said:
        register()  # what the start-up hook does, twice
        register()
    assert said.getvalue() == f"{moved}; its methods are off\n"
    assert {name for name in _METHODS if name.startswith("ram")} == {"ram", "ramplus_tl"}
    assert _METHODS["ram"] is ram_merge
    out = tmp_path / "out"
    recipe = write_recipe(str(tmp_path / "r.yml"), bf16_models.recipe("ram_plus"))
    refused = run_script("mergekit-yaml", recipe, str(out), check=False)
    assert (refused.returncode, refused.stderr.splitlines()) == (1, [f"Error: {moved}"]) and not out.exists()
    ram = tmp_path / "builtin-ram" / "out"  # the shared merge's folder name: the card's title
    merged = run_script("mergekit-yaml", builtin_ram_merge.recipe, str(ram))
    assert "mergekit-ram" not in merged.stderr
    for name in ("config.json", "mergekit_config.yml", "model.safetensors"):
        assert (ram / name).read_bytes() == Path(builtin_ram_merge.out, name).read_bytes(), name
