"""Ctrl-C in a command that runs a RAM merge: one line naming the output folder and what it holds, exit
status 130, no traceback and no click ``Aborted!``: during mergekit's imports, during the merge, while and once
the merge is published, after its table is shown. Other programs and other methods keep their own Ctrl-C.

Each run is the real console script in a new interpreter (signals and start-up are the subject), sent a real
SIGINT at a named moment by ``tests/faults/sitecustomize.py`` (its kill of its own process). SIGINT starts at
its default there, as in a terminal, whatever this test run inherited (a background job ignores it). The
merges it is compared with, and the count of the transaction's operations that finds its last rename, run in
this process (``run_script``), one interpreter a case.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import pytest

from tests.conftest import ModelSet, merge_in_process, run_script, script, write_recipe
from tests.faults import sitecustomize as faults
from tests.test_prepass import save_tokenizer

FAULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "faults")
NOTES = {"notes.txt": b"my notes\n"}


def interrupted(command: list[str], fault: str) -> subprocess.CompletedProcess:
    """``command`` (a console script and its arguments) run with the fault hook and SIGINT at its default."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MERGEKIT_RAM_TEST_FAULT": fault}
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
    """Exit status 130; ``line`` is stderr's last line and the only one naming ``out`` but the table's first; no
    traceback, no ``Aborted!``."""
    stderr = completed.stderr
    assert completed.returncode == 130, (completed.returncode, stderr[-3000:])
    assert "Traceback" not in stderr and "Aborted!" not in stderr, stderr[-3000:]
    lines = stderr.strip().splitlines()
    assert lines[-1] == line, stderr[-3000:]
    assert [text for text in lines if out in text and "merge written to" not in text] == [line], stderr[-3000:]


def snapshot(folder: str) -> dict[str, bytes]:
    """Every file under ``folder`` by relative path; the card's lines sorted (mergekit lists the models in a
    set's order)."""
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


#: (command, when SIGINT arrives, what the one line says the folder holds). "published": the transaction's
#: last rename (SIGINT is held while files move, acted on once they are all in); "shown": after the table.
MOMENTS = [
    (["mergekit-yaml"], "import:torch:1", "untouched"),
    (["mergekit-ram", "yaml"], "import:torch:1", "untouched"),
    (["mergekit-yaml"], "kernel:merge:2", "old"),
    (["mergekit-ram", "yaml"], "kernel:prepass:3", "old"),
    (["mergekit-pytorch"], "kernel:merge:2", "old"),
    (["mergekit-multi"], "kernel:merge:2", "old"),
    (["mergekit-yaml"], "published", "new"),
    (["mergekit-yaml"], "stderr:merge written to:1", "new"),
]


@pytest.mark.process
@pytest.mark.parametrize(("command", "moment", "holds"), MOMENTS, ids=[f"{' '.join(c)}-{m}" for c, m, _ in MOMENTS])
def test_ctrl_c_in_a_ram_merge_is_one_line(
    models: ModelSet, tmp_path, command: list[str], moment: str, holds: str
) -> None:
    recipe = models.recipe("ram_plus")
    if command == ["mergekit-pytorch"]:
        recipe["base_model"] = os.path.join(models.base, "model.safetensors")
        recipe["models"] = [{"model": os.path.join(path, "model.safetensors")} for path in models.agents]
    if command == ["mergekit-multi"]:
        recipe = {"name": "agents", **recipe}
    path = write_recipe(str(tmp_path / "r.yml"), recipe)
    multi = command == ["mergekit-multi"]
    stages = str(tmp_path / "stages")
    out = os.path.join(stages, "agents") if multi else str(tmp_path / "out")
    output = ["-I", stages, "--no-lazy"] if multi else [out]  # --lazy: skip what is there
    run = [script(command[0]), *command[1:], path, *output]
    if holds == "untouched":
        one_line(
            interrupted(run, f"{moment}:SIGINT"), "Interrupted before the merge started: the output folder is untouched"
        )
        assert not os.path.exists(out)
        return
    before = earlier_merge(models, out)
    into = str(tmp_path / "reference")  # the same merge over the same folder, not interrupted, in this process
    reference = os.path.join(into, "agents" if multi else "out")
    earlier_merge(models, reference)
    with faults.counted() as made:
        run_script(command[0], *command[1:], path, *(["-I", into, "--no-lazy"] if multi else [reference]))
    if moment == "published":  # the transaction's last rename
        moment = f"fsop:any:{max(number for number, call in enumerate(made, 1) if call.startswith('rename '))}"
    completed = interrupted(run, f"{moment}:SIGINT")
    if holds == "old":
        one_line(completed, f"Interrupted: nothing was published; {out} holds what it held before", out)
        assert snapshot(out) == before
    else:
        one_line(completed, f"Interrupted after the merge was published: {out} holds the complete new merge", out)
        assert snapshot(out) == snapshot(reference)


@pytest.mark.process
def test_ctrl_c_elsewhere_is_as_without_the_plugin(models: ModelSet, tmp_path) -> None:
    """Another program: Python's KeyboardInterrupt; mergekit's ``linear``, which mergekit writes straight into
    OUT: mergekit's own ``Aborted!``."""
    completed = interrupted([sys.executable, "-c", "import json"], "import:json:1:SIGINT")
    assert completed.returncode == -signal.SIGINT and "KeyboardInterrupt" in completed.stderr
    recipe = write_recipe(str(tmp_path / "r.yml"), models.recipe("linear", parameters={"weight": 1.0}))
    completed = interrupted([script("mergekit-yaml"), recipe, str(tmp_path / "out")], "open:config.json:1:SIGINT")
    assert completed.returncode == 1 and completed.stderr.strip().splitlines()[-1] == "Aborted!", completed.stderr


@pytest.mark.process
def test_ctrl_c_in_a_probe_or_a_check_is_one_line(models: ModelSet, ram_plus_merge, tmp_path) -> None:
    """The probe and the check only read (the check's one step that writes is its own): Ctrl-C ends them at once
    with one line and status 130, whatever a library was doing: a Ctrl-C while safetensors imports torch for the
    check once made it report a good weights file as "does not load"."""
    recipe = write_recipe(str(tmp_path / "r.yml"), models.recipe("ram_plus"))
    probed = interrupted([script("mergekit-ram"), "probe", recipe], "kernel:prepass:2:SIGINT")
    one_line(probed, "Interrupted: the probe stopped; nothing was merged")
    out = shutil.copytree(ram_plus_merge.out, str(tmp_path / "merged"))
    before = snapshot(out)
    checked = interrupted([script("mergekit-ram"), "check", out], "import:torch:1:SIGINT")
    one_line(checked, f"Interrupted: the check stopped; {out} was not changed", out)
    assert "problem" not in checked.stdout + checked.stderr and snapshot(out) == before
