"""Ctrl-C in a command that runs a RAM merge: one line naming the output folder and what it holds, exit
status 130, no traceback and no click ``Aborted!``: during mergekit's imports, during the merge, once the
merge is published.

Each run is the real console script in a subprocess, sent a real SIGINT at a named moment by
``tests/faults/sitecustomize.py`` (its kill of its own process). SIGINT starts at its default there, as in a
terminal, whatever this test run inherited (a background job ignores it).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import pytest

from mergekit_ram._autoload import runs_a_merge
from tests.conftest import ModelSet, merge_in_process, script, write_recipe
from tests.test_prepass import save_tokenizer

FAULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "faults")
NOTES = {"notes.txt": b"my notes\n"}


def interrupted(command: list[str], fault: str, **extra: str) -> subprocess.CompletedProcess:
    """``command`` (a console script and its arguments) run with the fault hook and SIGINT at its default."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MERGEKIT_RAM_TEST_FAULT": fault, **extra}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [FAULTS, os.environ.get("PYTHONPATH")]))
    return subprocess.run(
        command,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def one_line(completed: subprocess.CompletedProcess, line: str, out: str = "") -> None:
    """Exit status 130; ``line`` is stderr's last line and the only one naming ``out``; no traceback, no
    ``Aborted!``."""
    stderr = completed.stderr
    assert completed.returncode == 130, (completed.returncode, stderr[-3000:])
    assert "Traceback" not in stderr and "Aborted!" not in stderr, stderr[-3000:]
    lines = stderr.strip().splitlines()
    assert lines[-1] == line, stderr[-3000:]
    assert [text for text in lines if out in text] == [line], stderr[-3000:]


def snapshot(folder: str) -> dict[str, bytes]:
    """Every file under ``folder`` by relative path; the card's lines sorted (mergekit lists the models in a
    set's order), the manifest without the weights' identities."""
    found = {}
    for root, _dirs, files in os.walk(folder):
        for name in files:
            with open(os.path.join(root, name), "rb") as handle:
                data = handle.read()
            if name == "README.md":
                data = b"\n".join(sorted(data.split(b"\n")))
            found[os.path.relpath(os.path.join(root, name), folder)] = data
    return found


@pytest.fixture(scope="module")
def models(bf16_models: ModelSet, tmp_path_factory: pytest.TempPathFactory) -> ModelSet:
    """The tiny models, the base with a tokenizer (mergekit logs a traceback where it finds none to copy)."""
    base = shutil.copytree(bf16_models.base, str(tmp_path_factory.mktemp("interrupts") / "base"))
    save_tokenizer(base, ["<unk>"] + [f"t{i}" for i in range(1, 64)])
    return ModelSet(base=base, agents=bf16_models.agents, design=bf16_models.design)


def earlier_merge(models: ModelSet, out: str) -> dict[str, bytes]:
    """``out`` holding an earlier merge (mergekit's ``linear``) and the user's notes; its snapshot."""
    merge_in_process(models.recipe("linear", parameters={"weight": 1.0}), out)
    for name, data in NOTES.items():
        with open(os.path.join(out, name), "wb") as handle:
            handle.write(data)
    return snapshot(out)


@pytest.mark.parametrize("command", [["mergekit-yaml"], ["mergekit-ram", "yaml"]])
def test_ctrl_c_during_mergekits_imports(models: ModelSet, tmp_path, command: list[str]) -> None:
    recipe = write_recipe(str(tmp_path / "r.yml"), models.recipe("ram_plus"))
    out = str(tmp_path / "out")
    completed = interrupted([script(command[0]), *command[1:], recipe, out], "import:torch:1:SIGINT")
    one_line(completed, "Interrupted before the merge started: the output folder is untouched")
    assert not os.path.exists(out)


def test_other_programs_keep_pythons_ctrl_c() -> None:
    completed = interrupted([sys.executable, "-c", "import json"], "import:json:1:SIGINT")
    assert completed.returncode == -signal.SIGINT and "KeyboardInterrupt" in completed.stderr
    assert runs_a_merge(["/venv/bin/mergekit-multi", "x.yml"], True)
    assert runs_a_merge(["mergekit-ram", "pytorch"], False)  # it registers the plugin itself
    for argv in (["mergekit-moe", "x.yml"], ["mergekit-ram", "probe"], ["mergekit-ram", "check"], ["-c"], []):
        assert not runs_a_merge(argv, True), argv
    assert not runs_a_merge(["mergekit-yaml"], False)  # MERGEKIT_RAM_AUTOLOAD=0: nothing would hand SIGINT back


@pytest.mark.parametrize("command", [["mergekit-yaml"], ["mergekit-ram", "yaml"], ["mergekit-pytorch"]])
def test_ctrl_c_during_the_merge_keeps_the_folder(models: ModelSet, tmp_path, command: list[str]) -> None:
    recipe = models.recipe("ram_plus")
    if command == ["mergekit-pytorch"]:
        recipe["base_model"] = os.path.join(models.base, "model.safetensors")
        recipe["models"] = [{"model": os.path.join(path, "model.safetensors")} for path in models.agents]
    out = str(tmp_path / "out")
    before = earlier_merge(models, out)
    run = [script(command[0]), *command[1:], write_recipe(str(tmp_path / "r.yml"), recipe), out]
    completed = interrupted(run, "kernel:merge:2:SIGINT")
    one_line(completed, f"Interrupted: nothing was published; {out} holds what it held before", out)
    assert snapshot(out) == before


def test_ctrl_c_in_a_stage_of_mergekit_multi(models: ModelSet, tmp_path) -> None:
    stages = str(tmp_path / "stages")
    recipe = write_recipe(str(tmp_path / "multi.yml"), {"name": "agents", **models.recipe("ram_plus")})
    completed = interrupted([script("mergekit-multi"), recipe, "-I", stages], "kernel:merge:2:SIGINT")
    stage = os.path.join(stages, "agents")
    one_line(completed, f"Interrupted: nothing was published; {stage} holds what it held before", stage)
    assert not os.path.exists(stages)  # mergekit-multi made it: removed again


def test_ctrl_c_once_published_says_the_new_merge_is_complete(models: ModelSet, tmp_path) -> None:
    """SIGINT while the files move into OUT is held until they are all in (tests/test_transaction.py):
    the line says so. The run that counts the transaction's operations is the reference merge."""
    recipe = write_recipe(str(tmp_path / "r.yml"), models.recipe("ram_plus"))
    reference, out = str(tmp_path / "reference" / "out"), str(tmp_path / "faulted" / "out")
    for folder in (reference, out):
        earlier_merge(models, folder)
    count = str(tmp_path / "count")
    merged = interrupted([script("mergekit-yaml"), recipe, reference], "", MERGEKIT_RAM_TEST_COUNT=count)
    assert merged.returncode == 0, merged.stderr[-3000:]
    with open(count + ".trace", encoding="utf-8") as handle:
        renames = [line.split()[0] for line in handle if line.split()[1] == "rename"]
    completed = interrupted([script("mergekit-yaml"), recipe, out], f"fsop:any:{renames[-1]}:SIGINT")
    one_line(completed, f"Interrupted after the merge was published: {out} holds the complete new merge", out)
    assert snapshot(out) == snapshot(reference)


def test_other_methods_keep_mergekits_ctrl_c(models: ModelSet, tmp_path) -> None:
    """mergekit writes a ``linear`` merge straight into OUT: a Ctrl-C during it is mergekit's own ``Aborted!``."""
    recipe = write_recipe(str(tmp_path / "r.yml"), models.recipe("linear", parameters={"weight": 1.0}))
    completed = interrupted([script("mergekit-yaml"), recipe, str(tmp_path / "out")], "open:config.json:1:SIGINT")
    assert completed.returncode == 1 and completed.stderr.strip().splitlines()[-1] == "Aborted!", completed.stderr
