"""``mergekit-ram check OUT``: what stops sharing a merged model, through its click command in this process.

The clean folder is the shared ``ram_plus`` merge (tests/conftest.py) made shareable in the one step the
messages name: ``--hub-id`` for each local model and ``--set-license``, with a tokenizer copied in. Each
problem is then introduced alone into a copy of it, and must be the one line reported.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import yaml
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

import mergekit_ram.hub_ids  # noqa: F401  (imported before a test drops its privileges)
import mergekit_ram.sharing  # noqa: F401
from mergekit_ram.cli import main
from mergekit_ram.staging import output_transaction
from tests.conftest import Merged, ModelSet

MANIFEST_NOTE = (
    "note: hf upload would upload .mergekit-ram-manifest.json (mergekit-ram's record of the files its merge wrote "
    "here: keep it for the next merge), which is not part of the model: leave it out, hf upload ... --exclude "
    "'.mergekit-ram-*'"
)


def hub_fix(path: str) -> str:
    return (
        f"mergekit-ram check OUT --hub-id {path}=ORG/NAME for each local model (or --hub-id-file FILE) names them by "
        "their Hub ids in README.md, mergekit_config.yml and ram_statistics.json alike"
    )


def run(*arguments: str) -> Any:
    """``mergekit-ram ARGUMENTS`` (click's result); no traceback, whatever the folder holds."""
    result = CliRunner().invoke(main, list(arguments))
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exc_info
    assert "Traceback" not in result.output
    return result


def check(folder: Path, *options: str) -> tuple[int, list[str]]:
    """The exit status and the report's lines."""
    result = run("check", str(folder), *options)
    return result.exit_code, result.stdout.splitlines()


def refused(folder: Path, *options: str) -> str:
    """The one ``Error:`` line of a refusal (exit status 1)."""
    result = run("check", str(folder), *options)
    assert result.exit_code == 1 and result.stdout == "", result.output
    (line,) = result.stderr.splitlines()
    return line


def problems(folder: Path, *options: str) -> list[str]:
    """``check --json``'s problems, which must be the text report's problem lines."""
    status, lines = check(folder, *options)
    report = json.loads(run("check", str(folder), "--json", *options).stdout)
    assert [f"problem: {p['message']}" for p in report["problems"]] == [x for x in lines if x.startswith("problem:")]
    assert [f"note: {n['message']}" for n in report["notes"]] == [x for x in lines if x.startswith("note:")]
    assert status == (0 if report["ready"] else 1)
    return [problem["message"] for problem in report["problems"]]


def snapshot(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir()) if path.is_file()}


def edit_card(folder: Path, change: Callable[[dict], None]) -> None:
    """Change the card's front matter (parsed), keeping the rest of the card."""
    card = (folder / "README.md").read_text(encoding="utf-8")
    end = card.index("\n---\n", 4)
    metadata = yaml.safe_load(card[4:end])
    change(metadata)
    (folder / "README.md").write_text("---\n" + yaml.dump(metadata) + card[end + 1 :], encoding="utf-8")


def hub_id_options(models: ModelSet) -> list[str]:
    """``--hub-id PATH=org/NAME`` for the base and each agent."""
    return [f"--hub-id={path}=org/{os.path.basename(path)}" for path in [models.base, *models.agents]]


@pytest.fixture(scope="module")
def clean(bf16_models: ModelSet, ram_plus_merge: Merged, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shared merge made shareable in the one step; checked clean."""
    folder = tmp_path_factory.mktemp("check") / "clean"
    shutil.copytree(ram_plus_merge.out, folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_text("{}", encoding="utf-8")
    recipe = (folder / "mergekit_config.yml").read_text(encoding="utf-8")
    assert check(folder, *hub_id_options(bf16_models), "--set-license", "apache-2.0") == (
        0,
        [MANIFEST_NOTE, "ready to upload"],
    )
    renamed = yaml.safe_load(recipe)
    renamed["base_model"] = "org/base"
    renamed["models"] = [{**entry, "model": f"org/{os.path.basename(entry['model'])}"} for entry in renamed["models"]]
    assert yaml.safe_load((folder / "mergekit_config.yml").read_text(encoding="utf-8")) == renamed
    card = (folder / "README.md").read_text(encoding="utf-8")
    metadata = yaml.safe_load(card[4 : card.index("\n---\n", 4)])
    ids = ["org/base", "org/coding-agent", "org/memory-agent", "org/tool-agent"]
    assert metadata == {
        "base_model": ids,
        "base_model_relation": "merge",
        "library_name": "transformers",
        "license": "apache-2.0",
        "tags": ["mergekit", "merge", "mergekit-ram"],
    }
    return folder


def _nan(folder: Path) -> None:
    weights = load_file(folder / "model.safetensors")
    weights["model.layers.1.mlp.down_proj.weight"][3, 4] = float("nan")
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})


def _truncate(folder: Path) -> None:
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])


def _link(folder: Path, name: str) -> None:
    outside = folder.parent / f"outside-{name}"
    shutil.move(folder / name, outside)
    os.symlink(outside, folder / name)


def _statistics(change: Callable[[dict], None]) -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        data = json.loads((folder / "ram_statistics.json").read_text(encoding="utf-8"))
        change(data)
        (folder / "ram_statistics.json").write_text(json.dumps(data), encoding="utf-8")

    return edit


def _recipe_and_its_quote(old: str, new: str) -> Callable[[Path], None]:
    """The recipe changed alike in mergekit_config.yml and where the card quotes it."""

    def edit(folder: Path) -> None:
        for name in ("mergekit_config.yml", "README.md"):
            text = (folder / name).read_text(encoding="utf-8")
            assert old in text
            (folder / name).write_text(text.replace(old, new), encoding="utf-8")

    return edit


#: (problem introduced into a copy of the clean folder, the one problem reported; "..." ends a prefix)
CASES: dict[str, tuple[Callable[[Path], None], str]] = {
    "merge not finished": (
        lambda f: (f / "MERGE_INCOMPLETE").write_text("interrupted\n", encoding="utf-8"),
        "MERGE_INCOMPLETE is present: a merge into this folder was killed while publishing; merge into it again "
        "(it writes its own complete result)",
    ),
    "merge running": (
        lambda f: (f / ".mergekit-ram-0123456789abcdef").mkdir(),
        ".mergekit-ram-0123456789abcdef is present: a merge is writing into this folder, or one was killed; wait "
        "for it to finish, or check that hidden folder and remove it",
    ),
    "no weights": (
        lambda f: (f / "model.safetensors").unlink(),
        "no weights (*.safetensors): merge again with mergekit-yaml",
    ),
    "truncated weights": (_truncate, "model.safetensors does not load with safetensors (..."),
    "weights through a link": (
        lambda f: _link(f, "model.safetensors"),
        "model.safetensors cannot be read (it is a symbolic link): merge again",
    ),
    "NaN in the weights": (
        _nan,
        "model.safetensors: 1 tensor(s) hold NaN or Inf (model.layers.1.mlp.down_proj.weight): do not share it; "
        "check the inputs and merge again (a wider out_dtype where values overflow it)",
    ),
    "an index naming a file outside": (
        lambda f: (f / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": {"lm_head.weight": "../model.safetensors"}}), encoding="utf-8"
        ),
        "model.safetensors.index.json names ../model.safetensors, which is not a file of this folder: merge again",
    ),
    "an index naming no file": (
        lambda f: (f / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": {"lm_head.weight": None}}), encoding="utf-8"
        ),
        "model.safetensors.index.json has no weight_map of tensor names to files: merge again",
    ),
    "no config": (
        lambda f: (f / "config.json").unlink(),
        "no config.json: transformers cannot load the folder (mergekit-pytorch writes weights only): merge with "
        "mergekit-yaml",
    ),
    "no tokenizer": (
        lambda f: (f / "tokenizer.json").unlink(),
        "no tokenizer (tokenizer.json, tokenizer.model or vocab.json): copy the base model's tokenizer files "
        "(tokenizer_config.json and the others) into the folder",
    ),
    "a tokenizer through a link": (
        lambda f: _link(f, "tokenizer.json"),
        "tokenizer.json cannot be read (it is a symbolic link): copy the file itself into the folder",
    ),
    "no card": (
        lambda f: (f / "README.md").unlink(),
        "no README.md model card: merge with mergekit-yaml (without --no-write-model-card)",
    ),
    "a card without front matter": (
        lambda f: (f / "README.md").write_text("# A model\n", encoding="utf-8"),
        "README.md has no YAML front matter (between --- lines at its top): merge again with mergekit-yaml",
    ),
    "license other, unnamed": (
        lambda f: edit_card(f, lambda m: m.update(license="other")),
        "the card says license: other without license_name and license_link: add both to its front matter",
    ),
    "no base_model": (
        lambda f: edit_card(f, lambda m: m.pop("base_model")),
        "the card's front matter has no base_model (mergekit lists only Hub ids there): list the merged models' Hub "
        "ids under base_model (mergekit lists those of its recipe)",
    ),
    "a base_model that is not a list of ids": (
        lambda f: edit_card(f, lambda m: m.update(base_model={"org/base": 1})),
        "the card's base_model is {org/base: 1}, not a list of Hub ids: list the merged models' Hub ids",
    ),
    "no base_model_relation": (
        lambda f: edit_card(f, lambda m: m.pop("base_model_relation")),
        "the card's front matter has no base_model_relation: set base_model_relation: merge (the Hub's relation "
        "for a merge of the base_model models)",
    ),
    "another base_model_relation": (
        lambda f: edit_card(f, lambda m: m.update(base_model_relation="adapter")),
        "the card's front matter has base_model_relation: adapter: set base_model_relation: merge (the Hub's "
        "relation for a merge of the base_model models)",
    ),
    "no merge tag": (
        lambda f: edit_card(f, lambda m: m.update(tags=["mergekit", "mergekit-ram"])),
        "the card's front matter has no tag merge: add it under tags (mergekit writes mergekit, merge; "
        "mergekit-ram adds mergekit-ram)",
    ),
    "a local path in the card": (
        lambda f: edit_card(f, lambda m: m["base_model"].append("/data/models/agent")),
        f"README.md names local folders (/data/models/agent): {hub_fix('/data/models/agent')}",
    ),
    "a statistics warning": (
        _statistics(lambda data: data.update(warnings=["every model changed at least 90% of its parameters"])),
        "statistics warning: every model changed at least 90% of its parameters (--accept-warnings once it is "
        "understood)",
    ),
    "statistics that are not JSON": (
        lambda f: (f / "ram_statistics.json").write_text('{"schema": 2,', encoding="utf-8"),
        "ram_statistics.json is not the statistics file a merge writes (the file: Invalid JSON: EOF while parsing a "
        "value at line 1 column 13): merge again",
    ),
    "statistics whose models are a number": (  # issue 44, 5: a 58-line TypeError traceback on 5e7c16d
        _statistics(lambda data: data.update(models=1)),
        "ram_statistics.json is not the statistics file a merge writes (models: Input should be a valid array): merge "
        "again",
    ),
    "statistics with a warning that is not text": (
        _statistics(lambda data: data.update(warnings=[None])),
        "ram_statistics.json is not the statistics file a merge writes (warnings.0: Input should be a valid string): "
        "merge again",
    ),
    "a front matter that is not a mapping": (
        lambda f: (f / "README.md").write_text("---\n- a\n- b\n---\n# A model\n", encoding="utf-8"),
        "README.md's front matter cannot be read (repo card metadata block should be a dict): write it as plain "
        "YAML, as mergekit does, or merge again",
    ),
    "a recipe that is not YAML": (
        _recipe_and_its_quote("merge_method: ram_plus", "merge_method: [ram_plus"),
        "mergekit_config.yml is not a recipe mergekit reads (while parsing a flow sequence...",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_problem_alone_is_one_line(clean: Path, tmp_path, case: str) -> None:
    introduce, expected = CASES[case]
    folder = tmp_path / "out"
    shutil.copytree(clean, folder, symlinks=True)
    introduce(folder)
    started = time.perf_counter()
    status, lines = check(folder)
    assert time.perf_counter() - started < 10
    assert status == 1 and lines[-1] == "1 problem(s): do not upload yet", lines
    (problem,) = [line for line in lines if line.startswith("problem: ")]
    if expected.endswith("..."):
        assert problem.startswith(f"problem: {expected[:-3]}"), lines
    else:
        assert problem == f"problem: {expected}"
    assert "None" not in "\n".join(lines)


def test_a_crlf_card_has_front_matter(clean: Path, tmp_path) -> None:
    """Issue 44, 5: a card with CRLF line ends was reported as having no front matter, and --set-license wrote a
    second front matter above it (the Hub then lost base_model and the tags)."""
    folder = tmp_path / "out"
    shutil.copytree(clean, folder)
    edit_card(folder, lambda m: m.pop("license"))
    card = (folder / "README.md").read_text(encoding="utf-8").replace("\n", "\r\n")
    (folder / "README.md").write_bytes(card.encode())
    status, lines = check(folder)
    assert (status, [line for line in lines if line.startswith("problem")]) == (
        1,
        [
            "problem: the card's front matter has no license: mergekit-ram check OUT --set-license ID, with an id "
            "the input models' licences allow (apache-2.0, mit, ...)"
        ],
    )
    assert check(folder, "--set-license", "mit") == (0, [MANIFEST_NOTE, "ready to upload"])
    written = (folder / "README.md").read_bytes().decode()
    assert written.count("---\r\n") == 2 and written.startswith("---\r\nbase_model:\r\n- org/base\r\n")
    assert "\r\nlicense: mit\r\n" in written and "\n" not in written.replace("\r\n", "")
    assert written.split("\r\n---\r\n", 1)[1] == card.split("\r\n---\r\n", 1)[1]  # the body as it was


def test_every_problem_in_one_run(ram_plus_merge: Merged, bf16_models: ModelSet, tmp_path) -> None:
    """A merge of local folders, as it comes: every problem on the first run (5e7c16d showed the missing
    base_model_relation only once base_model was fixed, as "base_model_relation None"); text and JSON alike."""
    folder = tmp_path / "out"
    shutil.copytree(ram_plus_merge.out, folder)
    paths = sorted([bf16_models.base, *bf16_models.agents])
    assert problems(folder) == [
        "no tokenizer (tokenizer.json, tokenizer.model or vocab.json): copy the base model's tokenizer files "
        "(tokenizer_config.json and the others) into the folder",
        "the card's front matter has no license: mergekit-ram check OUT --set-license ID, with an id the input "
        "models' licences allow (apache-2.0, mit, ...)",
        "the card's front matter has no base_model (mergekit lists only Hub ids there): --hub-id writes it (below)",
        "the card's front matter has no base_model_relation: set base_model_relation: merge (the Hub's relation for "
        "a merge of the base_model models; --hub-id writes it)",
        f"README.md, mergekit_config.yml and ram_statistics.json name local folders ({', '.join(paths)}): "
        + hub_fix(paths[0]),
    ]
    status, lines = check(folder)
    assert status == 1 and "None" not in "\n".join(lines)


def test_json_report_and_accepted_warnings(clean: Path, tmp_path) -> None:
    folder = tmp_path / "out"
    shutil.copytree(clean, folder)
    warning = "a warning read and understood"
    _statistics(lambda data: data.update(warnings=[warning]))(folder)
    manifest = {"check": "upload", "message": MANIFEST_NOTE.removeprefix("note: ")}
    result = run("check", str(folder), "--json")
    assert result.exit_code == 1
    assert json.loads(result.stdout) == {
        "folder": str(folder),
        "ready": False,
        "problems": [
            {
                "check": "statistics",
                "message": f"statistics warning: {warning} (--accept-warnings once it is understood)",
            }
        ],
        "notes": [manifest],
        "changed": [],
    }
    assert check(folder, "--accept-warnings") == (
        0,
        [MANIFEST_NOTE, f"note: statistics warning: {warning}", "ready to upload"],
    )
    result = run("check", str(clean), "--json")
    assert result.exit_code == 0
    assert json.loads(result.stdout) == {
        "folder": str(clean),
        "ready": True,
        "problems": [],
        "notes": [manifest],
        "changed": [],
    }


def test_what_would_be_uploaded_and_is_not_the_model(clean: Path, tmp_path) -> None:
    """Issue 44, 8: ``hf upload`` leaves out only .git and .cache/huggingface; the manifest and stray files are named
    in one note, with the patterns that leave them out; a killed run's private folder is a problem."""
    folder = tmp_path / "out"
    shutil.copytree(clean, folder)
    (folder / "notes.txt").write_text("mine\n", encoding="utf-8")
    (folder / "eval [v1]").mkdir()
    (folder / ".git").mkdir()
    for name in ("generation_config.json", "chat_template.jinja", "model-00001-of-00002.safetensors.bak"):
        (folder / name).write_text("{}", encoding="utf-8")
    (folder / ".mergekit-ram-0123456789abcdef").mkdir()
    assert check(folder) == (
        1,
        [
            "note: hf upload would upload .mergekit-ram-manifest.json (mergekit-ram's record of the files its merge "
            "wrote here: keep it for the next merge), eval [v1]/, model-00001-of-00002.safetensors.bak, notes.txt, "
            "which are not part of the model: leave them out, hf upload ... --exclude '.mergekit-ram-*' --exclude "
            "'eval [[]v1]/' --exclude model-00001-of-00002.safetensors.bak --exclude notes.txt",
            "problem: .mergekit-ram-0123456789abcdef is present: a merge is writing into this folder, or one was "
            "killed; wait for it to finish, or check that hidden folder and remove it",
            "1 problem(s): do not upload yet",
        ],
    )


def test_many_stray_entries_are_one_note(clean: Path, tmp_path) -> None:
    folder = tmp_path / "out"
    shutil.copytree(clean, folder)
    for index in range(25):
        (folder / f"stray-{index:02}.txt").write_text("x", encoding="utf-8")
    status, lines = check(folder)
    assert status == 0 and len(lines) == 2
    assert lines[0].startswith("note: hf upload would upload .mergekit-ram-manifest.json (")
    assert lines[0].endswith(
        "stray-18.txt and 6 more, which are not part of the model: leave them out, hf upload ... --exclude "
        "'.mergekit-ram-*' --exclude stray-00.txt "
        + " ".join(f"--exclude stray-{index:02}.txt" for index in range(1, 19))
        + ", or move the rest out of the folder"
    )


class _Abandoned(Exception):
    """Ends a merge's transaction in a test without publishing anything."""


@contextlib.contextmanager
def merge_running(folder: Path) -> Iterator[None]:
    """The merge's own hold on ``folder`` (``staging.output_transaction``), left without publishing."""
    with contextlib.suppress(_Abandoned):
        with output_transaction(str(folder)):
            yield
            raise _Abandoned


def test_writes_wait_for_no_merge(clean: Path, bf16_models: ModelSet, tmp_path) -> None:
    """Issue 44, 1: ``--set-license`` took no lock and ignored MERGE_INCOMPLETE. Now every write into the folder
    (``--set-license``, ``--hub-id``) is refused while a merge holds it, while a killed merge's marker is there,
    and while a private folder is; nothing is written."""
    folder = tmp_path / "out"
    shutil.copytree(clean, folder)
    edit_card(folder, lambda m: m.pop("license"))
    for options in (["--set-license", "mit"], [*hub_id_options(bf16_models), "--set-license", "mit"]):
        before = snapshot(folder)
        with merge_running(folder):
            assert refused(folder, *options) == (
                f"Error: another merge is writing to {folder}; wait for it to finish or choose another output folder"
            )
        assert snapshot(folder) == before
        for name in ("MERGE_INCOMPLETE", ".mergekit-ram-0123456789abcdef"):
            (folder / name).mkdir() if name.startswith(".") else (folder / name).write_text("x\n", encoding="utf-8")
            assert refused(folder, *options) == (
                f"Error: {folder} is marked {name}: a merge into it was killed while publishing; merge into it again "
                "before changing its files"
                if name == "MERGE_INCOMPLETE"
                else f"Error: {folder} holds {folder / name}, left by a merge that was killed (the files it wrote or "
                "moved aside): remove it once you have what you need, then run this again"
            )
            (folder / name).rmdir() if name.startswith(".") else (folder / name).unlink()
            assert snapshot(folder) == before


@contextlib.contextmanager
def as_another_user() -> Iterator[None]:
    """This process without root's privileges for the block (its effective user 65534), where it is root."""
    if os.geteuid() != 0:
        yield
        return
    os.seteuid(65534)
    try:
        yield
    finally:
        os.seteuid(0)


def test_a_folder_the_user_cannot_write_is_one_line(clean: Path) -> None:
    """Issue 44, 5: ``--set-license`` into a folder the user cannot write was a 27-line PermissionError."""
    with tempfile.TemporaryDirectory() as parent:
        os.chmod(parent, 0o755)
        folder = Path(parent, "out")
        shutil.copytree(clean, folder)
        edit_card(folder, lambda m: m.pop("license"))
        before = snapshot(folder)
        os.chmod(folder, 0o555)
        try:
            with as_another_user():
                message = refused(folder, "--set-license", "mit")
        finally:
            os.chmod(folder, 0o755)
        assert message == f"Error: cannot change {folder} (Permission denied: .mergekit-ram.lock)"  # its lock
        assert snapshot(folder) == before


def test_usage_errors_exit_with_status_2(clean: Path, tmp_path) -> None:
    """No folder, a file for a folder, a licence id the Hub does not write, a --hub-id that is not LOCAL=ID or
    whose id is not one, one folder given two ids, a mapping file that is not one: click's usage error, status
    2, and nothing changed."""
    before = snapshot(clean)
    mapping = tmp_path / "ids.yml"
    mapping.write_text("- a\n- b\n", encoding="utf-8")
    for arguments, error in (
        ([str(tmp_path / "missing")], f"Invalid value for 'OUT': Directory '{tmp_path / 'missing'}' does not exist."),
        ([str(clean / "config.json")], f"Invalid value for 'OUT': Directory '{clean / 'config.json'}' is a file."),
        (
            [str(clean), "--set-license", "Apache 2.0"],
            "Invalid value for '--set-license': 'Apache 2.0' is not a licence id of the Hub (lower case, such as "
            "apache-2.0 or mit)",
        ),
        (
            [str(clean), "--hub-id", "./models/base"],
            "Invalid value for '--hub-id': './models/base' is not LOCAL=ID (a local model's folder, '=', its Hub "
            "id: ./models/coder=org/coder)",
        ),
        (
            [str(clean), "--hub-id", "./models/base=org/my model"],
            "Invalid value for '--hub-id': './models/base=org/my model': 'org/my model' is not a Hub model id (Repo "
            "id must use alphanumeric chars, '-', '_' or '.'. The name cannot start or end with '-' or '.' and the "
            "maximum length is 96: 'org/my model'.)",
        ),
        (
            [str(clean), "--hub-id", "./models/base=org/base@"],
            "Invalid value for '--hub-id': './models/base=org/base@': '' is not a revision (a branch, tag or commit "
            "after @)",
        ),
        (
            [str(clean), "--hub-id-file", str(mapping)],
            f"Invalid value for '--hub-id-file': {mapping} is not a mapping of local model folders to Hub ids "
            "({./models/coder: org/coder})",
        ),
    ):
        result = run("check", *arguments)
        assert (result.exit_code, result.stderr.splitlines()[-1]) == (2, f"Error: {error}")
    result = run("check", str(clean), "--hub-id", "./m/base=org/a", "--hub-id", "m/base/=org/b")
    assert (result.exit_code, result.stderr) == (
        1,
        "Error: m/base/ is given two Hub ids, org/a and org/b: give it one\n",
    )
    assert snapshot(clean) == before


def test_set_license_without_a_card_is_one_line(clean: Path, tmp_path) -> None:
    folder = tmp_path / "out"
    shutil.copytree(clean, folder)
    (folder / "README.md").unlink()
    assert refused(folder, "--set-license", "mit") == (
        f"Error: cannot set the licence of {folder}: there is no README.md (merge with mergekit-yaml, which writes "
        "the card)"
    )
    assert not (folder / "README.md").exists()
