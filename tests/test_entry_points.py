"""How users reach the methods: the start-up hook (in new interpreters: what it does at start-up is the
subject), its opt-out and register(), the real console script; the fallback console script, mergekit-multi and
mergekit-pytorch (their click commands in this process)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import yaml

from mergekit_ram.stats.render import display_names, format_rho
from mergekit_ram.stats.schema import read_ratio, statistics_from_dict
from tests.conftest import (
    Merged,
    ModelSet,
    load_statistics,
    load_weights,
    run_process,
    run_script,
    script,
    write_recipe,
)

OFF = {"MERGEKIT_RAM_AUTOLOAD": "0"}


def summary_rows(stderr: str, out: str) -> dict[str, list[str]]:
    """The table printed after the RAM merge into ``out``: model -> [density, rho, lambda]."""
    lines = stderr.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"ram_plus merge written to {out} ("))
    assert lines[start + 1].split() == ["model", "density", "changed", "shared", "unique", "rho", "lambda"]
    rows = {}
    for line in lines[start + 3 :]:
        cells = line.removesuffix(" (cap)").split()
        if len(cells) != 7 or not cells[1].endswith("%"):
            break
        rows[cells[0]] = [cells[1], *cells[5:]]
    return rows


def expected_rows(statistics: dict) -> dict[str, list[str]]:
    names = display_names(statistics_from_dict(statistics))
    return {
        names[m["model"]]: [
            f"{100 * m['density']:.2f}%",
            format_rho(read_ratio(m["rho"])),
            f"{m['lambda']:.4f}",
        ]
        for m in statistics["models"]
    }


def python(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return run_process([sys.executable, "-c", code], env)


@pytest.mark.process
def test_the_start_up_hook_registers_imports_nothing_heavy_and_can_be_off(bf16_models: ModelSet, tmp_path) -> None:
    """Importing mergekit finds the methods, without an import of the plugin; the hook itself imports nothing
    heavy; with ``MERGEKIT_RAM_AUTOLOAD=0`` mergekit is untouched (``ram_plus`` unknown to mergekit-yaml) until
    ``register()``."""
    completed = python(
        "import mergekit.merge_methods as m\n"
        "print(m.get('ram_plus').spec.name, type(m.get('ram')).__module__)\n"
        "from mergekit_ram.integration.registration import ours\n"
        "print([ours(name) is not None for name in ('ram', 'ram_plus')])"
    )
    assert completed.stdout.splitlines() == ["ram_plus mergekit.merge_methods.base", "[True, True]"], completed.stderr

    heavy = "torch mergekit pydantic numpy transformers typing click".split()
    # The hook's own imports, without `site`: an editable install's import shim (editables)
    # imports typing itself; a wheel has no shim.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    completed = run_process(
        [
            sys.executable,
            "-S",
            "-c",
            f"import sys; sys.path.insert(0, {root!r}); sys.argv = ['mergekit-yaml']; import mergekit_ram._autoload; "
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {heavy!r}))",
        ]
    )
    assert completed.stdout.strip() == "[]", completed.stdout + completed.stderr
    assert python("import sys; print('mergekit_ram._autoload' in sys.modules)").stdout.strip() == "True"

    recipe = write_recipe(str(tmp_path / "r.yml"), bf16_models.recipe("ram_plus"))
    completed = python(
        "import mergekit.merge_methods as m, mergekit.merge\n"
        "print('ram_plus' in [x.spec.name for x in m.registered_methods()], type(m.get('ram')).__module__,"
        " hasattr(mergekit.merge.run_merge, '__wrapped__'))\n"
        "from mergekit.scripts.run_yaml import main\n"
        "try:\n"
        f"    main.main(args=[{recipe!r}, {str(tmp_path / 'out')!r}], standalone_mode=False)\n"
        "except RuntimeError as error:\n"
        "    print(error)\n"
        "import mergekit_ram; mergekit_ram.register()\n"
        "from mergekit_ram.integration.registration import ours\n"
        "print('ram_plus' in [x.spec.name for x in m.registered_methods()], ours('ram') is not None,"
        " hasattr(mergekit.merge.run_merge, '__wrapped__'))",
        env=OFF,
    )
    assert completed.stdout.splitlines()[:1] + completed.stdout.splitlines()[-2:] == [
        "False mergekit.merge_methods.base False",
        "Unimplemented merge method ram_plus",
        "True True True",
    ], completed.stderr


@pytest.mark.process
def test_the_real_console_script_merges_as_in_process(ram_plus_merge: Merged, tmp_path) -> None:
    """The installed mergekit-yaml, in a new interpreter: the start-up hook and the seam give the bytes, the
    statistics and the table the in-process run gives; the plugin's warnings are plain ``warning:`` lines."""
    out = str(tmp_path / "out")
    with open(ram_plus_merge.recipe, encoding="utf-8") as handle:
        recipe = yaml.safe_load(handle)
    recipe["models"][0]["parameters"] = {"weight": 0.5}  # another method's: ignored, with a warning
    completed = run_process([script("mergekit-yaml"), write_recipe(str(tmp_path / "r.yml"), recipe), out])
    assert completed.returncode == 0, completed.stderr[-3000:]
    warned = [line for line in completed.stderr.splitlines() if "ignores parameter 'weight'" in line]
    assert warned and warned[0].startswith("warning: ram_plus ignores parameter 'weight' (in models[0].parameters)")
    assert "WARNING:mergekit_ram" not in completed.stderr, completed.stderr[-3000:]
    assert summary_rows(completed.stderr, out) == expected_rows(load_statistics(out))
    assert load_statistics(out)["models"] == load_statistics(ram_plus_merge.out)["models"]
    expected = load_weights(ram_plus_merge.out)
    assert all(torch.equal(tensor, expected[name]) for name, tensor in load_weights(out).items())


def test_fallback_console_script(ram_plus_merge: Merged, tmp_path) -> None:
    recipe, reference_out = ram_plus_merge.recipe, ram_plus_merge.out  # mergekit-yaml, the start-up hook on
    assert summary_rows(ram_plus_merge.stderr, reference_out) == expected_rows(load_statistics(reference_out))
    assert len(expected_rows(load_statistics(reference_out))) == 3
    out = str(tmp_path / "out")
    quiet = run_script("mergekit-ram", "yaml", recipe, out, "--quiet")
    assert "merge written to" not in quiet.stderr and "lambda" not in quiet.stderr + quiet.stdout
    assert load_statistics(out)["models"] == load_statistics(reference_out)["models"]
    expected = load_weights(reference_out)
    assert all(torch.equal(tensor, expected[name]) for name, tensor in load_weights(out).items())


def test_mergekit_multi_with_a_ram_stage(bf16_models: ModelSet, tmp_path) -> None:
    stages = [
        {"name": "agents", **bf16_models.recipe("ram_plus", parameters={"r": 0.1})},
        {
            "merge_method": "linear",
            "models": [
                {"model": "agents", "parameters": {"weight": 0.5}},
                {"model": bf16_models.base, "parameters": {"weight": 0.5}},
            ],
            "dtype": "bfloat16",
        },
    ]
    config = str(tmp_path / "multi.yml")
    with open(config, "w", encoding="utf-8") as handle:
        yaml.safe_dump_all(stages, handle, sort_keys=False)
    intermediate = str(tmp_path / "stages")
    final = str(tmp_path / "final")
    completed = run_script("mergekit-multi", config, "--intermediate-dir", intermediate, "--out-path", final)
    statistics = load_statistics(os.path.join(intermediate, "agents"))
    assert summary_rows(completed.stderr, os.path.join(intermediate, "agents")) == expected_rows(statistics)
    assert completed.stderr.count("merge written to") == 1  # the RAM stage; the linear one has none
    assert statistics["method"] == "ram_plus" and statistics["source"] == "pre-pass"
    assert "## RAM statistics" in open(os.path.join(intermediate, "agents", "README.md"), encoding="utf-8").read()
    ram_weights = load_weights(os.path.join(intermediate, "agents"))
    base = load_weights(bf16_models.base)
    name = "model.layers.0.mlp.up_proj.weight"
    expected = (0.5 * ram_weights[name].float() + 0.5 * base[name].float()).to(torch.bfloat16)
    torch.testing.assert_close(load_weights(final)[name], expected, rtol=0.01, atol=1e-3)


def test_mergekit_pytorch_uses_global_rho(bf16_models: ModelSet, ram_plus_merge: Merged, tmp_path) -> None:
    yaml_out = ram_plus_merge.out
    raw_recipe = {
        "merge_method": "ram_plus",
        "base_model": os.path.join(bf16_models.base, "model.safetensors"),
        "models": [{"model": os.path.join(path, "model.safetensors")} for path in bf16_models.agents],
    }
    raw_out = str(tmp_path / "raw")
    completed = run_script("mergekit-pytorch", write_recipe(str(tmp_path / "raw.yml"), raw_recipe), raw_out)
    raw_lambdas = [m["lambda"] for m in load_statistics(raw_out)["models"]]
    rows = summary_rows(completed.stderr, raw_out)
    assert rows == expected_rows(load_statistics(raw_out)) and len(rows) == 3
    assert [row[2] for row in rows.values()] == [f"{value:.4f}" for value in raw_lambdas]
    assert raw_lambdas == [m["lambda"] for m in load_statistics(yaml_out)["models"]]
    expected = load_weights(yaml_out)
    actual = load_weights(raw_out)
    assert set(actual) == set(expected)
    assert all(torch.equal(actual[name], expected[name]) for name in expected)
