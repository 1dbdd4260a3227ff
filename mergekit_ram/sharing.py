"""``mergekit-ram check OUT``: what stops a merged model folder from being shared on the Hub, every problem in
one run, one line each with its fix; notes do not stop sharing. The folder is a stranger's: read through ``files``
(never through a link, bounded) and ``bounded_yaml``, its naming files through ``hub_ids``.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import shlex
import stat
from typing import Any, NamedTuple, Optional, Union

import yaml
from safetensors import safe_open

import mergekit_ram.bounded_yaml as bounded_yaml
import mergekit_ram.hub_ids as hub
from mergekit_ram.errors import MergedFolderError, one_line
from mergekit_ram.files import UnreadableFile, open_regular
from mergekit_ram.published import Card, listed
from mergekit_ram.staging import MANIFEST_FILE, MARKER_FILE, PRIVATE_PREFIX
from mergekit_ram.stats.render import card_markdown, terminal_text
from mergekit_ram.stats.schema import statistics_from_dict

CARD, RECIPE, STATISTICS, INDEX = *hub.NAMING_FILES, "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")  # what transformers loads, with its config
LICENSE_ID = re.compile(r"[a-z0-9][a-z0-9.+-]*")  # a Hub licence id: apache-2.0, llama3.1, cc-by-nc-4.0, other
#: What a model repository holds for transformers and the Hub: the card and its licence texts, the configuration,
#: the weights and their index, the tokenizer's files (those ``save_pretrained`` writes for the tokenizers of
#: causal language models), the generation configuration, the chat template, a processor's configuration; and
#: the merge's recipe and statistics.
MODEL_FILES = frozenset(
    {
        CARD, ".gitattributes", "LICENSE", "LICENSE.md", "LICENSE.txt", "NOTICE", "USE_POLICY.md",
        "config.json", "generation_config.json", RECIPE, STATISTICS, INDEX, "pytorch_model.bin.index.json",
        "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "tokenizer.model",
        "vocab.json", "merges.txt", "vocab.txt", "spiece.model", "sentencepiece.bpe.model",
        "chat_template.jinja", "chat_template.json", "preprocessor_config.json", "processor_config.json",
    }
)  # fmt: skip
#: ... and files by pattern: weights (shards included), a model's own code (``trust_remote_code``), tiktoken files.
MODEL_PATTERN = re.compile(
    r"[^/]+\.safetensors|pytorch_model(-\d+-of-\d+)?\.bin|(configuration|modeling|tokenization)_\w+\.py|[^/]+\.tiktoken"
)
NOT_UPLOADED = frozenset({".git", ".cache"})  # what ``hf upload`` leaves out by itself (huggingface_hub's)
LISTED, SHOWN = 20, 120  # entries named one by one at most; characters of a front matter value quoted at most
ANOTHER_MERGE = "the card is another merge's; merge again (a merge writes the card, recipe and statistics together)"
_SETTINGS_LINE = re.compile(r"^Merged with `([^`]*)` \((.*)\); counts from ", re.MULTILINE)


class Finding(NamedTuple):
    """A line of the report; ``check`` names the check for scripts; a note does not stop sharing."""

    check: str
    message: str
    note: bool = False


class Report(NamedTuple):
    folder: str
    findings: list[Finding]
    changed: list[str] = []  # the files ``--hub-id`` or ``--set-license`` rewrote first

    def of(self, note: bool) -> list[Finding]:
        return [finding for finding in self.findings if finding.note == note]

    @property
    def ready(self) -> bool:
        return not self.of(note=False)

    def to_json(self) -> dict[str, Any]:
        problems, notes = ([{"check": f.check, "message": f.message} for f in self.of(note)] for note in (False, True))
        return dict(folder=self.folder, ready=self.ready, problems=problems, notes=notes, changed=self.changed)

    def lines(self) -> list[str]:
        """One line per finding, notes first (unprintable characters of a stranger's names escaped), the verdict."""
        lines = [f"{'note' if f.note else 'problem'}: {f.message}" for f in self.of(True) + self.of(False)]
        verdict = "ready to upload" if self.ready else f"{len(self.of(False))} problem(s): do not upload yet"
        return [terminal_text(line) for line in lines] + [verdict]


def read_file(folder: int, name: str, check: str) -> Union[str, Finding, None]:
    """``hub_ids.read_text`` (None: absent), or the finding that the file cannot be read."""
    try:
        return hub.read_text(folder, name)
    except hub.UNREADABLE as error:
        return Finding(check, f"{name} cannot be read ({hub.reason(error)}): replace it with the merge's own")


def check_folder(out: str, accept_warnings: bool = False, changed: Optional[list[str]] = None) -> Report:
    """``accept_warnings`` makes statistics warnings notes; ``changed``: what was rewritten first (reported)."""
    try:
        folder = os.open(out, os.O_RDONLY | os.O_DIRECTORY)  # the user's own path: a link to a folder is followed
    except OSError as error:
        raise MergedFolderError(f"cannot open the folder {out} ({error.strerror or error})") from None
    try:
        names = set(os.listdir(folder))
        found = incomplete(names) + weights(folder, names, out) + config(folder) + tokenizer(folder)
        found += uploaded(folder, names)
        read = [
            read_file(folder, name, check) for name, check in zip(hub.NAMING_FILES, ("card", "recipe", "statistics"))
        ]
    finally:
        os.close(folder)
    card, recipe, statistics = texts = [text if isinstance(text, str) else None for text in read]
    files = hub.parse(dict(zip(hub.NAMING_FILES, texts)))
    local = [path for path in hub.all_paths(hub.folder_paths(files)) if hub.is_local(path)]
    found += [problem for problem in read if isinstance(problem, Finding)]
    if CARD in files.errors:
        unreadable = files.errors[CARD]
        found.append(
            Finding("card", f"{unreadable}: write it as plain YAML without aliases, as mergekit does, or merge again")
        )
    if RECIPE in files.errors:
        found.append(Finding("recipe", f"{files.errors[RECIPE]}: merge again (mergekit writes the recipe it ran)"))
    if not isinstance(read[2], Finding):
        found += statistics_findings(statistics, files.statistics, accept_warnings)
    if not isinstance(read[0], Finding) and CARD not in files.errors:
        found += card_findings(card, files.card, files.statistics, local)
    return Report(out, found + consistency(recipe, files) + local_paths(files, local), list(changed or []))


def incomplete(names: set[str]) -> list[Finding]:
    """The plugin's transaction marks a folder it has not finished publishing into."""
    killed = (
        f"{MARKER_FILE} is present: a merge into this folder was killed while publishing; merge into it again (it "
        "writes its own complete result)"
    )
    running = [
        f"{name} is present: a merge is writing into this folder, or one was killed; wait for it to finish, or check "
        "that hidden folder and remove it"
        for name in _private(names)
    ]
    return [Finding("incomplete", message) for message in [killed] * (MARKER_FILE in names) + running]


def _private(names: set[str]) -> list[str]:
    return sorted(name for name in names if name.startswith(PRIVATE_PREFIX) and name != MANIFEST_FILE)


def weights(folder: int, names: set[str], out: str) -> list[Finding]:
    """The index names files of the folder; every weights file loads (``tensor_findings``)."""
    files = sorted(name for name in names if name.endswith(".safetensors"))
    if not files:
        return [Finding("weights", "no weights (*.safetensors): merge again with mergekit-yaml")]
    index = read_file(folder, INDEX, "weights") if INDEX in names else '{"weight_map": {}}'
    data = hub.strict_json(index) if not isinstance(index, Finding) else None  # JSON as strangers write it
    shards = data.get("weight_map") if isinstance(data, dict) else None
    if isinstance(shards, dict) and all(isinstance(shard, str) for shard in shards.values()):
        missing = sorted(set(shards.values()) - names)  # the folder's own entries: plain names
        found = [
            Finding("weights", f"{INDEX} names {shard}, which is not a file of this folder: merge again")
            for shard in missing
        ]
    else:
        found = [
            index
            if isinstance(index, Finding)
            else Finding("weights", f"{INDEX} has no weight_map of tensor names to files: merge again")
        ]
    return found + [finding for name in files for finding in tensor_findings(folder, name, out)]


def tensor_findings(folder: int, name: str, out: str) -> list[Finding]:
    """Every tensor loads with safetensors, one at a time, and a floating one holds no NaN or Inf."""
    try:
        with open_regular(name, dir_fd=folder, follow_symlinks=False):
            with safe_open(os.path.join(out, name), framework="pt") as tensors:
                bad = [key for key in tensors.keys() if not _finite(tensors.get_tensor(key))]
    except (OSError, UnreadableFile) as error:
        return [Finding("weights", f"{name} cannot be read ({hub.reason(error)}): merge again")]
    except Exception as error:  # safetensors' own refusal of a damaged file, whatever its type
        return [Finding("weights", f"{name} does not load with safetensors ({one_line(error)}): merge again")]
    shown = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
    message = (
        f"{name}: {len(bad)} tensor(s) hold NaN or Inf ({shown}): do not share it; check the inputs and merge again "
        "(a wider out_dtype where values overflow it)"
    )
    return [Finding("finite", message)] if bad else []


def _finite(tensor: Any) -> bool:
    return not tensor.is_floating_point() or bool(tensor.isfinite().all())


def config(folder: int) -> list[Finding]:
    text = read_file(folder, "config.json", "config")
    missing = (
        "no config.json: transformers cannot load the folder (mergekit-pytorch writes weights only): merge with "
        "mergekit-yaml"
    )
    return [text if isinstance(text, Finding) else Finding("config", missing)] if not isinstance(text, str) else []


def tokenizer(folder: int) -> list[Finding]:
    """A tokenizer file as a regular file of the folder (a link is not uploaded as the file everywhere)."""
    problems = []
    for name in TOKENIZER_FILES:
        try:
            with open_regular(name, dir_fd=folder, follow_symlinks=False):
                return []
        except FileNotFoundError:
            pass
        except (OSError, UnreadableFile) as error:
            problems.append(f"{name} cannot be read ({hub.reason(error)}): copy the file itself into the folder")
    missing = (
        f"no tokenizer ({', '.join(TOKENIZER_FILES[:-1])} or {TOKENIZER_FILES[-1]}): copy the base model's "
        "tokenizer files (tokenizer_config.json and the others) into the folder"
    )
    return [Finding("tokenizer", (problems + [missing])[0])]


def uploaded(folder: int, names: set[str]) -> list[Finding]:
    """Entries ``hf upload`` would upload that are not part of the model (notes: the user decides), each with the
    ``--exclude`` pattern that leaves it out (a ``*`` there also matches across folders); ``LISTED`` at most."""
    extra = names - MODEL_FILES - NOT_UPLOADED - {MARKER_FILE} - set(_private(names))  # a killed merge's: problems
    stray = sorted(name for name in extra if not MODEL_PATTERN.fullmatch(name) and name != MANIFEST_FILE)
    shown = stray if len(stray) <= LISTED else stray[: LISTED - 1]
    notes = [
        f"{MANIFEST_FILE} is mergekit-ram's record of the files its merge wrote here (keep it for the next merge), "
        f"not part of the model: leave it out, hf upload ... --exclude '{PRIVATE_PREFIX}*'"
    ] * (MANIFEST_FILE in extra)
    for name in shown:
        pattern = shlex.quote(glob.escape(name) + ("/" if _is_folder(folder, name) else ""))
        notes.append(
            f"{name} is not part of the model, and hf upload would upload it: move it out of the folder, or leave it "
            f"out, hf upload ... --exclude {pattern}"
        )
    if len(shown) < len(stray):
        notes.append(f"{len(stray) - len(shown)} more entries are not part of the model: move them out of the folder")
    return [Finding("upload", note, note=True) for note in notes]


def _is_folder(folder: int, name: str) -> bool:
    """A folder of ``folder`` itself (a link is not followed)."""
    with contextlib.suppress(OSError):
        return stat.S_ISDIR(os.stat(name, dir_fd=folder, follow_symlinks=False).st_mode)
    return False


def statistics_findings(text: Optional[str], data: Any, accept_warnings: bool) -> list[Finding]:
    """``data``: the file's object where its reader takes it."""
    if text is None:
        return [Finding("statistics", "no ram_statistics.json: not a merge with mergekit-ram's methods", note=True)]
    warnings = data.get("warnings", []) if isinstance(data, dict) else None
    if not isinstance(warnings, list) or not all(isinstance(warning, str) for warning in warnings):
        return [Finding("statistics", "ram_statistics.json is not the statistics file a merge writes: merge again")]
    hint = "" if accept_warnings else " (--accept-warnings once it is understood)"
    return [Finding("statistics", f"statistics warning: {w}{hint}", note=accept_warnings) for w in warnings]


def shown(value: Any) -> str:
    """A front matter value as YAML writes it (``merge``, ``[a, b]``, ``null``), never as Python does; cut short."""
    with contextlib.suppress(yaml.YAMLError):
        text = yaml.safe_dump(value, default_flow_style=True, width=1 << 16).strip().removesuffix("...").strip()
        return text if len(text) <= SHOWN else text[: SHOWN - 3] + "..."
    return "a value that is not YAML"


def card_findings(text: Optional[str], card: Optional[Card], statistics: Any, local: list[str]) -> list[Finding]:
    """The card's front matter as the Hub reads it: a licence, ``base_model`` and ``base_model_relation: merge``,
    the merge tag; every one checked, whatever the others found."""
    if text is None:
        return [Finding("card", "no README.md model card: merge with mergekit-yaml (without --no-write-model-card)")]
    if card is None or card.metadata is None:
        missing = "README.md has no YAML front matter (between --- lines at its top): merge again with mergekit-yaml"
        return [Finding("card", missing)]
    get, found = card.metadata.get, []
    base_model, relation, tags = get("base_model"), get("base_model_relation"), get("tags")
    if not get("license"):
        message = (
            "the card's front matter has no license: mergekit-ram check OUT --set-license ID, with an id the input "
            "models' licences allow (apache-2.0, mit, ...)"
        )
        found.append(Finding("license", message))
    if get("license") == "other" and not (get("license_name") and get("license_link")):
        message = "the card says license: other without license_name and license_link: add both to its front matter"
        found.append(Finding("license", message))
    if not listed(base_model):
        fix = "list the merged models' Hub ids under base_model (mergekit lists those of its recipe)"
        fix = "--hub-id writes it (below)" if local else fix
        message = f"the card's front matter has no base_model (mergekit lists only Hub ids there): {fix}"
        found.append(Finding("base_model", message))
    if any(not isinstance(name, str) or not name for name in listed(base_model)):
        message = (
            f"the card's base_model is {shown(base_model)}, not a list of Hub ids: list the merged models' Hub ids"
        )
        found.append(Finding("base_model", message))
    if relation != "merge":
        has = (
            "the card's front matter has no base_model_relation"
            if relation is None
            else f"the card's front matter has base_model_relation: {shown(relation)}"
        )
        message = f"{has}: set base_model_relation: merge (the Hub's relation for a merge of the base_model models" + (
            "; --hub-id writes it)" if local else ")"
        )
        found.append(Finding("base_model_relation", message))
    if not (isinstance(tags, list) and "merge" in tags):
        message = (
            "the card's front matter has no tag merge: add it under tags (mergekit writes mergekit, merge; "
            "mergekit-ram adds mergekit-ram)"
        )
        found.append(Finding("tags", message))
    missing_section = statistics is not None and "## RAM statistics" not in card.body
    return found + [Finding("card", "README.md has no RAM statistics section", note=True)] * missing_section


def consistency(recipe: Optional[str], files: hub.Parsed) -> list[Finding]:
    """Whether the card, the recipe and the statistics describe one merge: a write into the folder while a merge
    published (an earlier ``--set-license``) could leave another merge's card beside the new recipe and statistics."""
    found, card, statistics = [], files.card, files.statistics
    block = hub.RECIPE_BLOCK.search(card.body) if card is not None else None
    if block is not None and recipe is not None and block[1].strip() != recipe.strip():
        found.append(f"{CARD} quotes another recipe than {RECIPE}: {ANOTHER_MERGE}")
    if card is not None and statistics is not None and "## RAM statistics" in card.body:
        found += section_differences(card.body, statistics_from_dict(statistics))
    recipe_paths = set(files.recipe or [])
    if files.recipe is not None and statistics is not None:
        counted = [name for name in hub.statistics_models(statistics) if set(hub.reference_paths(name)) - recipe_paths]
        if counted:
            found.append(f"{STATISTICS} counts models {RECIPE} does not merge ({', '.join(counted)}): merge again")
        if (method := _recipe_method(recipe)) is not None and method != statistics.get("method"):
            found.append(f"{STATISTICS} is of a {statistics.get('method')} merge, {RECIPE} of {method}: merge again")
    if files.recipe is not None and card is not None and card.metadata is not None:
        models = [name for name in listed(card.metadata.get("base_model")) if isinstance(name, str)]
        for name in [name for name in models if name not in recipe_paths and not hub.is_local(name)]:
            found.append(f"the card's base_model lists {name}, which {RECIPE} does not merge: {ANOTHER_MERGE}")
        if (hub_models := sorted(p for p in recipe_paths if not hub.is_local(p) and p not in models)) and models:
            found.append(
                f"the card's base_model does not list {', '.join(hub_models)}, which {RECIPE} merges: add "
                f"{'it' if len(hub_models) == 1 else 'them'} (mergekit lists every Hub model of its recipe)"
            )
    return [Finding("consistency", message) for message in found]


def section_differences(body: str, statistics: Any) -> list[str]:
    """The card's RAM statistics (settings line, table) against those the statistics file makes."""
    expected, found = card_markdown(statistics), []
    settings, wanted = _SETTINGS_LINE.search(body), _SETTINGS_LINE.search(expected)
    if wanted is not None and (settings is None or settings.groups() != wanted.groups()):
        described = f"a {settings[1]} merge with {settings[2]}" if settings is not None else "no settings"
        found.append(
            f"{CARD}'s RAM statistics describe {described}, {STATISTICS} a {wanted[1]} merge with {wanted[2]}: "
            + ANOTHER_MERGE
        )
    table, expected_table = _statistics_table(body), _statistics_table(expected)
    models, expected_models = [row[0] for row in table], [row[0] for row in expected_table]
    if models != expected_models:
        found.append(
            f"{CARD}'s RAM statistics list {', '.join(models) or 'no models'}, {STATISTICS} "
            f"{', '.join(expected_models)}: {ANOTHER_MERGE}"
        )
    elif table != expected_table:
        differing = ", ".join(row[0] for row, other in zip(table, expected_table) if row != other)
        found.append(f"{CARD}'s RAM statistics give other figures than {STATISTICS} for {differing}: " + ANOTHER_MERGE)
    return found


def _statistics_table(text: str) -> list[list[str]]:
    """The rows (cells) of the first table after the RAM statistics heading, header and rule left out."""
    rows = []
    for line in text[text.find("## RAM statistics") :].splitlines():
        if line.startswith("|"):
            rows.append([cell.strip().replace("\\|", "|") for cell in re.split(r"(?<!\\)\|", line)[1:-1]])
        elif rows:
            break
    return rows[2:]


def _recipe_method(text: Optional[str]) -> Optional[str]:
    """The merge method of a one-document recipe."""
    with contextlib.suppress(bounded_yaml.UnreadableYaml):
        recipe = bounded_yaml.load_one(text or "", RECIPE)
        method = recipe.get("merge_method") if isinstance(recipe, dict) else None
        return method if isinstance(method, str) else None
    return None


def local_paths(files: hub.Parsed, local: list[str]) -> list[Finding]:
    """The naming files that name local folders (readers of the card cannot find those models), with the step
    that names them by their Hub ids."""
    card, warnings = files.card, (files.statistics or {}).get("warnings") or []
    named = {
        CARD: listed((card.metadata or {}).get("base_model")) + hub.mentions(card.body, local) if card else [],
        RECIPE: files.recipe or [],
        STATISTICS: [path for name in hub.statistics_models(files.statistics) for path in hub.reference_paths(name)]
        + hub.mentions(" ".join(w for w in warnings if isinstance(w, str)), local),
    }
    naming = [name for name in hub.NAMING_FILES if any(path in local for path in named[name])]
    paths = sorted({path for name in naming for path in named[name] if path in local})
    if not naming:
        return []
    named_by = naming[0] + " names" if len(naming) == 1 else f"{', '.join(naming[:-1])} and {naming[-1]} name"
    return [
        Finding(
            "local_paths",
            f"{named_by} local folders ({', '.join(paths)}): mergekit-ram check OUT --hub-id {paths[0]}=ORG/NAME for "
            "each local model (or --hub-id-file FILE) names them by their Hub ids in README.md, mergekit_config.yml "
            "and ram_statistics.json alike",
        )
    ]
