"""A mergekit whose internals moved: the plugin steps aside, and says so.

The "moved" mergekit is the installed one copied into a temporary folder, with one internal the
plugin uses renamed throughout it (mergekit itself still works) and its version bumped where
mergekit keeps it: the distribution's metadata (``importlib.metadata.version("mergekit")``; mergekit
has no ``__version__``) and the version its ``tensor_writer`` writes into an index. That folder goes
first on ``PYTHONPATH`` of the real console scripts, as a source build kept beside the plugin would.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import ModelSet, load_weights, run_script, write_recipe

VERSION = "0.2.0"
#: (file of mergekit, internal renamed throughout it): the registry's table, which the start-up hook
#: needs first (registering the methods), and a helper the planner needs only at merge time.
REGISTRY_MOVED = ("merge_methods/registry.py", "_METHODS", "_REGISTERED")
MERGE_MOVED = ("merge.py", "_model_out_config", "_output_model_config")
METHODS = ("ram", "ram_plus", "ram_ties", "ram_unique")


@dataclass(frozen=True)
class MovedMergekit:
    root: str  # the folder to put first on PYTHONPATH
    moved: str  # the internal, as the plugin's message names it

    @property
    def env(self) -> dict[str, str]:
        return {"PYTHONPATH": self.root, "MERGEKIT_RAM_AUTOLOAD": "1"}

    @property
    def reason(self) -> str:
        return (
            f"mergekit-ram cannot find {self.moved} in mergekit {VERSION} ({self.root}/mergekit); it supports "
            'mergekit>=0.1.5,<0.2 where that is unchanged (tested: 0.1.5): pip install "mergekit==0.1.5"'
        )

    @property
    def warning(self) -> str:
        """The one start-up line of every run."""
        return (
            f"{self.reason}; until then mergekit-ram is not active: recipes naming ram, ram_plus, ram_ties, "
            "ram_unique are refused and other methods run as mergekit alone (pip uninstall mergekit-ram to use "
            "this mergekit without it)"
        )

    def refusal(self, method: str) -> str:
        return f"Error: merge_method {method} is mergekit-ram's, which is not active here: {self.reason}"


def build_moved_mergekit(root: Path, file: str, old: str, new: str) -> MovedMergekit:
    """The installed mergekit copied under ``root``, ``old`` renamed ``new`` in every file that has it,
    its version ``VERSION``."""
    spec = importlib.util.find_spec("mergekit")
    assert spec is not None and spec.submodule_search_locations
    package = root / "mergekit"
    shutil.copytree(spec.submodule_search_locations[0], package, ignore=shutil.ignore_patterns("__pycache__"))
    renamed = []
    for path in package.rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        if old in text:
            path.write_text(text.replace(old, new), encoding="utf-8")
            renamed.append(path.relative_to(package).as_posix())
    assert file in renamed, f"mergekit has no {old} in {file} any more: rename another internal"
    writer = package / "io" / "tensor_writer.py"  # the version it writes into an index's metadata
    written = f'"mergekit_version": "{importlib.metadata.version("mergekit")}"'
    writer.write_text(writer.read_text(encoding="utf-8").replace(written, f'"mergekit_version": "{VERSION}"'), "utf-8")
    info = root / f"mergekit-{VERSION}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: mergekit\nVersion: {VERSION}\n", encoding="utf-8")
    module = file.removesuffix(".py").replace("/", ".")
    return MovedMergekit(root=str(root), moved=f"mergekit.{module}.{old}")


@pytest.fixture(scope="module")
def moved(tmp_path_factory: pytest.TempPathFactory) -> MovedMergekit:
    return build_moved_mergekit(tmp_path_factory.mktemp("moved-registry"), *REGISTRY_MOVED)


def python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True, check=False
    )


def test_the_moved_mergekit_is_the_one_found(moved: MovedMergekit) -> None:
    completed = python(
        "import importlib.metadata as m, mergekit; print(m.version('mergekit'), *mergekit.__path__)",
        {"PYTHONPATH": moved.root},
    )
    assert completed.stdout.split() == [VERSION, os.path.join(moved.root, "mergekit")], completed.stderr


@pytest.mark.parametrize(
    "method, parameters",
    [("ram", {}), ("ram_plus", {}), ("ram_plus", {"rule": "clip"}), ("ram_ties", {}), ("ram_unique", {})],
    ids=["ram", "ram_plus", "ram_plus-rule-clip", "ram_ties", "ram_unique"],
)
def test_mergekit_yaml_refuses_the_methods_in_one_line(
    moved: MovedMergekit, bf16_models: ModelSet, tmp_path, method: str, parameters: dict
) -> None:
    """Not mergekit's built-in ``ram``, not a pydantic traceback, not "Unimplemented merge method"."""
    recipe = bf16_models.recipe(method, **({"parameters": parameters} if parameters else {}))
    out = tmp_path / "out"
    completed = run_script(
        "mergekit-yaml", write_recipe(str(tmp_path / "r.yml"), recipe), str(out), env=moved.env, check=False
    )
    assert completed.returncode == 1
    assert completed.stderr.splitlines() == [moved.warning, moved.refusal(method)]
    assert not out.exists()


def test_other_methods_run_as_mergekit_alone(moved: MovedMergekit, bf16_models: ModelSet, tmp_path) -> None:
    """A linear merge with the plugin stepped aside writes what mergekit alone writes, after one warning line."""
    recipe = {
        "merge_method": "linear",
        "models": [{"model": path, "parameters": {"weight": 1.0}} for path in [bf16_models.base, *bf16_models.agents]],
        "dtype": "bfloat16",
    }
    path = write_recipe(str(tmp_path / "linear.yml"), recipe)
    aside, alone = tmp_path / "aside" / "out", tmp_path / "alone" / "out"  # one name: the card's title
    completed = run_script("mergekit-yaml", path, str(aside), "--no-copy-tokenizer", env=moved.env)
    assert completed.stderr.splitlines()[0] == moved.warning
    assert completed.stderr.count("mergekit-ram") == moved.warning.count("mergekit-ram")
    run_script(
        "mergekit-yaml", path, str(alone), "--no-copy-tokenizer", env={**moved.env, "MERGEKIT_RAM_AUTOLOAD": "0"}
    )
    assert (
        sorted(os.listdir(aside))
        == sorted(os.listdir(alone))
        == [
            "README.md",
            "config.json",
            "mergekit_config.yml",
            "model.safetensors",
        ]
    )
    for name in ("config.json", "mergekit_config.yml", "model.safetensors"):
        assert (aside / name).read_bytes() == (alone / name).read_bytes(), name
    card, card_alone = ((folder / "README.md").read_text(encoding="utf-8") for folder in (aside, alone))
    assert sorted(card.splitlines()) == sorted(card_alone.splitlines())  # mergekit lists the models from a set
    assert load_weights(str(aside))


@pytest.mark.parametrize("autoload", ["1", "0"])
def test_the_fallback_command_refuses_too(moved: MovedMergekit, bf16_models: ModelSet, tmp_path, autoload: str) -> None:
    """``mergekit-ram yaml`` (which registers explicitly): the one line for a RAM recipe, not a
    ``MergekitMovedError`` traceback; a linear recipe runs as mergekit alone."""
    env = {**moved.env, "MERGEKIT_RAM_AUTOLOAD": autoload}
    path = write_recipe(str(tmp_path / "r.yml"), bf16_models.recipe("ram_plus"))
    refused = run_script("mergekit-ram", "yaml", path, str(tmp_path / "out"), env=env, check=False)
    assert refused.returncode == 1
    assert refused.stderr.splitlines() == [moved.warning] * (autoload == "1") + [moved.refusal("ram_plus")]
    linear = {"merge_method": "linear", "models": [{"model": bf16_models.base, "parameters": {"weight": 1.0}}]}
    path = write_recipe(str(tmp_path / "linear.yml"), linear)
    run_script("mergekit-ram", "yaml", path, str(tmp_path / "linear"), "--no-copy-tokenizer", env=env)
    assert os.path.exists(tmp_path / "linear" / "config.json")


def test_mergekit_multi_pytorch_and_the_probe_refuse(moved: MovedMergekit, bf16_models: ModelSet, tmp_path) -> None:
    stages = write_recipe(str(tmp_path / "multi.yml"), {"name": "agents", **bf16_models.recipe("ram_ties")})
    completed = run_script(
        "mergekit-multi", stages, "-I", str(tmp_path / "stages"), "--out-path", str(tmp_path / "out"),
        env=moved.env, check=False,
    )  # fmt: skip
    assert (completed.returncode, completed.stderr.splitlines()) == (1, [moved.warning, moved.refusal("ram_ties")])
    raw = {
        "merge_method": "ram",
        "base_model": os.path.join(bf16_models.base, "model.safetensors"),
        "models": [{"model": os.path.join(path, "model.safetensors")} for path in bf16_models.agents],
    }
    raw_path = write_recipe(str(tmp_path / "raw.yml"), raw)
    completed = run_script("mergekit-pytorch", raw_path, str(tmp_path / "raw"), env=moved.env, check=False)
    assert (completed.returncode, completed.stderr.splitlines()) == (1, [moved.warning, moved.refusal("ram")])
    recipe = write_recipe(str(tmp_path / "r.yml"), bf16_models.recipe("ram_plus"))
    probe = run_script("mergekit-ram", "probe", recipe, env=moved.env, check=False)
    assert probe.returncode == 1
    assert probe.stderr.splitlines()[-1] == f"Error: {moved.reason}"
    assert not any(os.path.exists(tmp_path / name) for name in ("stages", "out", "raw"))


def test_run_merge_refuses_and_a_late_move_takes_the_registration_back(bf16_models: ModelSet, tmp_path) -> None:
    """A moved ``mergekit.merge`` found only once the methods were registered (``mergekit.merge_methods``
    imported first): the registration is taken back (mergekit's built-in ``ram`` again, no ``ram_plus``),
    and ``run_merge`` refuses ``ram`` in one line instead of running the built-in method."""
    late = build_moved_mergekit(tmp_path / "moved-merge", *MERGE_MOVED)
    code = (
        "import mergekit.merge_methods as m\n"
        "print(type(m.get('ram')).__module__)\n"
        "import mergekit.merge, mergekit.config, mergekit.options\n"
        "print(type(m.get('ram')).__module__, [x.spec.name for x in m.registered_methods() if 'ram' in x.spec.name])\n"
        f"config = mergekit.config.MergeConfiguration.model_validate({bf16_models.recipe('ram')!r})\n"
        f"mergekit.merge.run_merge(config, {str(tmp_path / 'out')!r}, mergekit.options.MergeOptions())\n"
    )
    completed = python(code, late.env)
    assert completed.stdout.splitlines() == [
        "mergekit_ram.integration.methods",
        "mergekit.merge_methods.base ['ram', 'ramplus_tl']",
    ]
    assert late.warning in completed.stderr.splitlines()
    assert (
        completed.stderr.splitlines()[-1]
        == f"mergekit_ram.integration.internals.MergekitMovedError: {late.refusal('ram').removeprefix('Error: ')}"
    )
    assert not os.path.exists(tmp_path / "out")
