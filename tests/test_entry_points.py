"""How users reach the methods: the automatic registration, its opt-out, register(), the
fallback console script, mergekit-multi, mergekit-pytorch and the demo."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
import yaml

from mergekit_ram.stats.render import display_names, format_rho
from mergekit_ram.stats.schema import read_ratio, statistics_from_dict
from tests.conftest import (
    COLD_VARIABLE,
    Merged,
    ModelSet,
    load_statistics,
    load_weights,
    run_script,
    script,
    warm_run,
    write_recipe,
)

OFF = {"MERGEKIT_RAM_AUTOLOAD": "0"}


def summary_rows(stderr: str, out: str) -> dict[str, list[str]]:
    """The table printed after the RAM merge into ``out``: model -> [density, rho, lambda]."""
    lines = stderr.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"ram_plus merge written to {out} ("))
    assert lines[start + 1].split() == ["model", "density", "rho", "lambda"]
    rows = {}
    for line in lines[start + 3 :]:
        cells = line.split()
        if len(cells) != 4 or not cells[1].endswith("%"):
            break
        rows[cells[0]] = cells[1:]
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
    return subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **(env or {})}, capture_output=True, text=True, check=False
    )


def test_methods_are_found_without_an_import() -> None:
    completed = python(
        "import mergekit.merge_methods as m; print(m.get('ram_plus').spec.name, type(m.get('ram')).__module__)"
    )
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.split() == ["ram_plus", "mergekit_ram.integration.methods"]


def test_startup_hook_imports_nothing_heavy() -> None:
    heavy = "torch mergekit pydantic numpy transformers typing".split()
    # The hook's own imports, without `site`: an editable install's import shim (editables)
    # imports typing itself; a wheel has no shim.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    completed = subprocess.run(
        [
            sys.executable,
            "-S",
            "-c",
            f"import sys; sys.path.insert(0, {root!r}); import mergekit_ram._autoload; "
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {heavy!r}))",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert completed.stdout.strip() == "[]", completed.stdout + completed.stderr
    assert python("import sys; print('mergekit_ram._autoload' in sys.modules)").stdout.strip() == "True"


def test_opt_out_leaves_mergekit_untouched_and_register_restores() -> None:
    completed = python(
        "import mergekit.merge_methods as m\n"
        "print('ram_plus' in [x.spec.name for x in m.registered_methods()], type(m.get('ram')).__module__)\n"
        "import mergekit_ram; mergekit_ram.register()\n"
        "print('ram_plus' in [x.spec.name for x in m.registered_methods()], type(m.get('ram')).__module__)",
        env=OFF,
    )
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.split() == [
        "False",
        "mergekit.merge_methods.base",
        "True",
        "mergekit_ram.integration.methods",
    ]


def test_opt_out_mergekit_yaml_does_not_know_ram_plus(bf16_models: ModelSet, tmp_path) -> None:
    recipe = write_recipe(str(tmp_path / "r.yml"), bf16_models.recipe("ram_plus"))
    completed = run_script("mergekit-yaml", recipe, str(tmp_path / "out"), env=OFF, check=False)
    assert completed.returncode != 0
    assert "Unimplemented merge method ram_plus" in completed.stderr


def test_fallback_console_script(ram_plus_merge: Merged, tmp_path) -> None:
    recipe, reference_out = ram_plus_merge.recipe, ram_plus_merge.out  # mergekit-yaml, the start-up hook on
    assert summary_rows(ram_plus_merge.stderr, reference_out) == expected_rows(load_statistics(reference_out))
    assert len(expected_rows(load_statistics(reference_out))) == 3
    out = str(tmp_path / "out")
    quiet = run_script("mergekit-ram", "yaml", recipe, out, "--quiet", env=OFF)
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


#: A program whose end shows each step of an interpreter's: output not flushed, a thread still running,
#: an atexit function, and the exit status of ``sys.exit(argv[1])``.
ENDINGS = """
import atexit, sys, threading, time
print("printed, not flushed")
atexit.register(print, "atexit")
threading.Thread(target=lambda: (time.sleep(0.2), print("thread"))).start()
code = sys.argv[1]
sys.exit(None if code == "none" else int(code) if code.isdigit() else code)
"""


def test_a_warm_run_ends_as_a_fresh_run(tmp_path) -> None:
    """The warm interpreter's end (``finish``, without the modules' teardown): the thread joined, the atexit
    function run, the output flushed, and ``sys.exit``'s status and message, as a fresh run ends."""
    program = tmp_path / "endings.py"
    program.write_text(ENDINGS, encoding="utf-8")
    buffered = {name: value for name, value in os.environ.items() if name != "PYTHONUNBUFFERED"}
    for code in ("none", "3", "a message"):
        cold = subprocess.run([sys.executable, str(program), code], env=buffered, capture_output=True, text=True)
        warm = warm_run([str(program), code], buffered)
        assert warm is not None, code
        assert (warm.returncode, warm.stdout, warm.stderr) == (cold.returncode, cold.stdout, cold.stderr), code
    assert (cold.returncode, cold.stdout, cold.stderr) == (1, "printed, not flushed\nthread\natexit\n", "a message\n")


def test_a_warm_run_is_a_fresh_run(ram_plus_merge: Merged, tmp_path) -> None:
    """``run_script`` forks most runs from a warm interpreter (tests/warm_interpreter.py): the same
    exit status, output, files and traceback as the script started afresh."""
    typo = tmp_path / "typo.yml"
    recipe = Path(ram_plus_merge.recipe).read_text(encoding="utf-8")
    typo.write_text(recipe.replace("ram_plus", "ram_pluss"), encoding="utf-8")
    syntax = tmp_path / "syntax.yml"
    syntax.write_text("merge_method: linear\nmodels: [{model: a}\n", encoding="utf-8")  # mergekit's traceback
    runs = {
        "merge": (ram_plus_merge.recipe, str(tmp_path / "merged"), "--quiet"),
        "one-line error": (str(typo), str(tmp_path / "refused")),
        "traceback": (str(syntax), str(tmp_path / "broken")),
    }
    for case, arguments in runs.items():
        cold = run_script("mergekit-yaml", *arguments, env={COLD_VARIABLE: "1"}, check=False)
        warm = warm_run([script("mergekit-yaml"), *arguments], {**os.environ, "HF_HUB_OFFLINE": "1"})  # last to write
        assert warm is not None, f"{case}: the warm interpreter cannot serve (its imports failed or started a thread)"
        assert (warm.returncode, warm.stdout, warm.stderr) == (cold.returncode, cold.stdout, cold.stderr), case
    assert warm.returncode == 1 and warm.stderr.startswith("Traceback (most recent call last):\n  File ")
    assert f'"{script("mergekit-yaml")}", line' in warm.stderr.splitlines()[1]
    merged, expected = load_weights(str(tmp_path / "merged")), load_weights(ram_plus_merge.out)
    assert merged.keys() == expected.keys() and all(torch.equal(merged[k], expected[k]) for k in expected)
