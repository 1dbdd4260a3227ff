"""``mergekit-ram check OUT``: what stops a merged model folder from being shared on the Hub, every problem in
one run, one line each with its fix; notes do not stop sharing. The folder is a stranger's (``mergekit_ram.files``,
``mergekit_ram.bounded_yaml``). Writing the Hub ids and the licence into it is ``mergekit_ram.hub_ids``.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import shlex
import stat
from typing import Any, Iterator, NamedTuple, Optional

import yaml
from safetensors import safe_open

import mergekit_ram.bounded_yaml as bounded_yaml
from mergekit_ram.errors import MergedFolderError, one_line
from mergekit_ram.files import JSON_LIMIT, UnreadableFile, descriptor_path, open_regular, read_regular
from mergekit_ram.hub_ids import (
    Parsed,
    Reference,
    all_paths,
    folder_paths,
    is_local,
    mentions,
    quoted_references,
    readable_statistics,
    recipe_block,
    recipe_references,
    reference_paths,
    statistics_models,
    strict_json,
)
from mergekit_ram.published import CARD_TAG, Card, read_card
from mergekit_ram.staging import MANIFEST_FILE, MARKER_FILE, PRIVATE_PREFIX
from mergekit_ram.stats.render import card_markdown, terminal_text
from mergekit_ram.stats.schema import STATISTICS_FILE, statistics_from_dict

CARD, RECIPE, CONFIG, INDEX = "README.md", "mergekit_config.yml", "config.json", "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")  # what transformers loads, with its config
NAMING_FILES = (CARD, RECIPE, STATISTICS_FILE)  # the files that name the merged models, in report order
LICENSE_ID = re.compile(r"[a-z0-9][a-z0-9.+-]*")  # a Hub licence id: apache-2.0, llama3.1, cc-by-nc-4.0, other
MERGE_TAG = "merge"
#: What a model repository holds for transformers and the Hub: the card and its licence texts, the configuration,
#: the weights and their index, the tokenizer's files (those ``save_pretrained`` writes for the tokenizers of
#: causal language models), the generation configuration, the chat template, a processor's configuration; and
#: the merge's recipe and statistics.
MODEL_FILES = frozenset(
    {
        CARD, ".gitattributes", "LICENSE", "LICENSE.md", "LICENSE.txt", "NOTICE", "USE_POLICY.md",
        CONFIG, "generation_config.json", RECIPE, STATISTICS_FILE, INDEX, "pytorch_model.bin.index.json",
        "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "tokenizer.model",
        "vocab.json", "merges.txt", "vocab.txt", "spiece.model", "sentencepiece.bpe.model",
        "chat_template.jinja", "chat_template.json", "preprocessor_config.json", "processor_config.json",
    }
)  # fmt: skip
#: ... and files by pattern: weights (shards included), a model's own code (``trust_remote_code``), tiktoken files.
MODEL_PATTERN = re.compile(
    r"[^/]+\.safetensors|pytorch_model(-\d+-of-\d+)?\.bin|(configuration|modeling|tokenization)_\w+\.py|[^/]+\.tiktoken"
)
#: What ``hf upload`` leaves out by itself (huggingface_hub's DEFAULT_IGNORE_PATTERNS, FORBIDDEN_FOLDERS).
NOT_UPLOADED = frozenset({".git", ".cache"})
LISTED = 20  # entries named one by one at most; the rest in one note
SHOWN = 120  # characters of a front matter value quoted in a message at most
#: Where ``hub_ids`` fixes what a finding names.
HUB_ID_FIX = (
    "mergekit-ram check OUT --hub-id {path}=ORG/NAME for each local model (or --hub-id-file FILE) names them by "
    "their Hub ids in README.md, mergekit_config.yml and ram_statistics.json alike"
)
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
        return {
            "folder": self.folder,
            "ready": self.ready,
            "problems": problems,
            "notes": notes,
            "changed": self.changed,
        }

    def lines(self) -> list[str]:
        """One line per finding (unprintable characters of a stranger's names escaped), then the verdict."""
        problems = len(self.of(note=False))
        verdict = f"{problems} problem(s): do not upload yet" if problems else "ready to upload"
        shown = [f"{'note' if f.note else 'problem'}: {f.message}" for f in self.of(True) + self.of(False)]
        return [terminal_text(line) for line in shown] + [verdict]


class FolderFile(NamedTuple):
    name: str
    text: Optional[str]  # None where absent or unreadable (``problem``)
    problem: Optional[Finding] = None


def _reason(error: Exception) -> str:
    return error.strerror if isinstance(error, OSError) and error.strerror else one_line(error)


@contextlib.contextmanager
def opened_folder(out: str) -> Iterator[int]:
    """The user's own path: a link to a folder is followed."""
    try:
        folder = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as error:
        raise MergedFolderError(f"cannot open the folder {out} ({error.strerror or error})") from None
    try:
        yield folder
    finally:
        os.close(folder)


def read_file(folder: int, name: str, check: str) -> FolderFile:
    """A regular file of the folder (not a link), bounded, UTF-8."""
    try:
        return FolderFile(name, read_regular(name, JSON_LIMIT, dir_fd=folder, follow_symlinks=False).decode("utf-8"))
    except FileNotFoundError:
        return FolderFile(name, None)
    except (OSError, UnreadableFile, UnicodeDecodeError) as error:
        message = f"{name} cannot be read ({_reason(error)}): replace it with the merge's own"
        return FolderFile(name, None, Finding(check, message))


class Readings(NamedTuple):
    """The naming files as far as they parse: what cannot be is a finding, and reads as absent."""

    card: Optional[Card]
    references: Optional[list[Reference]]  # None: no recipe, or one that does not parse
    statistics: Any  # the JSON object where its reader takes it, else None
    findings: list[Finding]


def readings(card: FolderFile, recipe: FolderFile, statistics: FolderFile) -> Readings:
    findings = []
    parsed_card = references = None
    if card.text is not None:
        try:
            parsed_card = read_card(card.text)
        except bounded_yaml.UnreadableYaml as error:
            findings.append(
                Finding("card", f"{error}: write it as plain YAML without aliases, as mergekit does, or merge again")
            )
    if recipe.text is not None:
        try:
            references = recipe_references(bounded_yaml.compose(recipe.text, RECIPE))
        except bounded_yaml.UnreadableYaml as error:
            findings.append(Finding("recipe", f"{error}: merge again (mergekit writes the recipe it ran)"))
    data = strict_json(statistics.text) if statistics.text is not None else None
    return Readings(parsed_card, references, data if readable_statistics(data) else None, findings)


def check_folder(out: str, accept_warnings: bool = False, changed: Optional[list[str]] = None) -> Report:
    """``accept_warnings`` makes statistics warnings notes; ``changed``: what was rewritten first (reported)."""
    with opened_folder(out) as folder:
        names = set(os.listdir(folder))
        files = card, recipe, statistics = [
            read_file(folder, name, check) for name, check in zip(NAMING_FILES, ("card", "recipe", "statistics"))
        ]
        findings = [*incomplete(names), *weights(folder, names), *config(folder), *tokenizer(folder)]
        findings += uploaded(folder, names)
    findings += [file.problem for file in files if file.problem is not None]
    read = readings(card, recipe, statistics)
    named = Parsed(read.card, read.references or [], read.statistics, quoted_references(read.card))
    local = [path for path in all_paths(folder_paths(named)) if is_local(path)]
    findings += read.findings + statistics_findings(statistics, read.statistics, accept_warnings)
    findings += card_findings(card, read.card, read.statistics, local)
    findings += consistency(card, recipe, read)
    return Report(out, findings + local_paths(read, local), list(changed or []))


def config(folder: int) -> list[Finding]:
    file = read_file(folder, CONFIG, "config")
    missing = (
        f"no {CONFIG}: transformers cannot load the folder (mergekit-pytorch writes weights only): merge with "
        "mergekit-yaml"
    )
    return [file.problem or Finding("config", missing)] if file.text is None else []


def incomplete(names: set[str]) -> list[Finding]:
    """The plugin's transaction marks a folder it has not finished publishing into."""
    killed = (
        f"{MARKER_FILE} is present: a merge into this folder was killed while publishing; merge into it again (it "
        "writes its own complete result)"
    )
    private = sorted(name for name in names if name.startswith(PRIVATE_PREFIX) and name != MANIFEST_FILE)
    return [Finding("incomplete", killed)] * (MARKER_FILE in names) + [
        Finding(
            "incomplete",
            f"{name} is present: a merge is writing into this folder, or one was killed; wait for it to finish, or "
            "check that hidden folder and remove it",
        )
        for name in private
    ]


def weights(folder: int, names: set[str]) -> list[Finding]:
    files = sorted(name for name in names if name.endswith(".safetensors"))
    if not files:
        return [Finding("weights", "no weights (*.safetensors): merge again with mergekit-yaml")]
    found = index_findings(folder, names) if INDEX in names else []
    return found + [finding for name in files for finding in tensor_findings(folder, name)]


def index_findings(folder: int, names: set[str]) -> list[Finding]:
    index = read_file(folder, INDEX, "weights")
    if index.problem is not None:
        return [index.problem]
    data = strict_json(index.text or "")  # JSON as strangers write it
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(shard, str) for shard in weight_map.values()):
        return [Finding("weights", f"{INDEX} has no weight_map of tensor names to files: merge again")]
    return [
        Finding("weights", f"{INDEX} names {shard}, which is not a file of this folder: merge again")
        for shard in sorted(set(weight_map.values()))
        if shard not in names  # the folder's own entries: plain names
    ]


def tensor_findings(folder: int, name: str) -> list[Finding]:
    """Every tensor loads with safetensors, one at a time, and a floating one holds no NaN or Inf."""
    try:
        with open_regular(name, dir_fd=folder, follow_symlinks=False) as (handle, _):
            path = descriptor_path(handle)  # the descriptor's own file, whatever becomes of the name (/proc)
            if path is None:
                return [Finding("weights", f"{name} cannot be read: /proc is not mounted here (mount it)")]
            with safe_open(path, framework="pt") as tensors:
                bad = [key for key in tensors.keys() if not is_finite(tensors.get_tensor(key))]
    except (OSError, UnreadableFile) as error:
        return [Finding("weights", f"{name} cannot be read ({_reason(error)}): merge again")]
    except Exception as error:  # safetensors' own refusal of a damaged file, whatever its type
        return [Finding("weights", f"{name} does not load with safetensors ({one_line(error)}): merge again")]
    shown = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
    message = (
        f"{name}: {len(bad)} tensor(s) hold NaN or Inf ({shown}): do not share it; check the inputs and merge again "
        "(a wider out_dtype where values overflow it)"
    )
    return [Finding("finite", message)] if bad else []


def is_finite(tensor: Any) -> bool:
    return not tensor.is_floating_point() or bool(tensor.isfinite().all())


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
            problems.append(f"{name} cannot be read ({_reason(error)}): copy the file itself into the folder")
    problems.append(
        f"no tokenizer ({', '.join(TOKENIZER_FILES[:-1])} or {TOKENIZER_FILES[-1]}): copy the base model's "
        "tokenizer files (tokenizer_config.json and the others) into the folder"
    )
    return [Finding("tokenizer", problems[0])]


def uploaded(folder: int, names: set[str]) -> list[Finding]:
    """Entries ``hf upload`` would upload that are not part of the model (notes: the user decides), each with the
    ``--exclude`` pattern that leaves it out (a ``*`` there also matches across folders); ``LISTED`` at most."""
    killed = {MARKER_FILE} | {name for name in names if name.startswith(PRIVATE_PREFIX) and name != MANIFEST_FILE}
    extra = names - MODEL_FILES - NOT_UPLOADED - killed  # a killed merge's entries: a problem of their own
    stray = sorted(name for name in extra if not MODEL_PATTERN.fullmatch(name) and name != MANIFEST_FILE)
    found = [
        Finding(
            "upload",
            f"{MANIFEST_FILE} is mergekit-ram's record of the files its merge wrote here (keep it for the next merge), "
            f"not part of the model: leave it out, hf upload ... --exclude '{PRIVATE_PREFIX}*'",
            note=True,
        )
    ] * (MANIFEST_FILE in extra)
    shown = stray if len(stray) <= LISTED else stray[: LISTED - 1]
    for name in shown:
        pattern = shlex.quote(glob.escape(name) + ("/" if _is_folder(folder, name) else ""))
        message = (
            f"{name} is not part of the model, and hf upload would upload it: move it out of the folder, or leave it "
            f"out, hf upload ... --exclude {pattern}"
        )
        found.append(Finding("upload", message, note=True))
    if len(shown) < len(stray):
        message = f"{len(stray) - len(shown)} more entries are not part of the model: move them out of the folder"
        found.append(Finding("upload", message, note=True))
    return found


def _is_folder(folder: int, name: str) -> bool:
    """A folder of ``folder`` itself (a link is not followed)."""
    with contextlib.suppress(OSError):
        return stat.S_ISDIR(os.stat(name, dir_fd=folder, follow_symlinks=False).st_mode)
    return False


def statistics_findings(statistics: FolderFile, data: Any, accept_warnings: bool) -> list[Finding]:
    """``data``: the file's object where its reader takes it."""
    if statistics.problem is not None:
        return []  # reported with the files
    if statistics.text is None:
        return [Finding("statistics", f"no {STATISTICS_FILE}: not a merge with mergekit-ram's methods", note=True)]
    warnings = data.get("warnings") if isinstance(data, dict) else None
    if data is None or not (
        warnings is None or isinstance(warnings, list) and all(isinstance(w, str) for w in warnings)
    ):
        return [Finding("statistics", f"{STATISTICS_FILE} is not the statistics file a merge writes: merge again")]
    hint = "" if accept_warnings else " (--accept-warnings once it is understood)"
    return [
        Finding("statistics", f"statistics warning: {warning}{hint}", note=accept_warnings)
        for warning in warnings or ()
    ]


def shown(value: Any) -> str:
    """A front matter value as YAML writes it (``merge``, ``[a, b]``, ``null``), never as Python does; cut short."""
    with contextlib.suppress(yaml.YAMLError):
        text = yaml.safe_dump(value, default_flow_style=True, width=1 << 16).strip().removesuffix("...").strip()
        return text if len(text) <= SHOWN else text[: SHOWN - 3] + "..."
    return "a value that is not YAML"


def card_findings(file: FolderFile, card: Optional[Card], statistics: Any, local: list[str]) -> list[Finding]:
    """The card's front matter as the Hub reads it: a licence, ``base_model`` and ``base_model_relation: merge``,
    the merge tag; every one checked, whatever the others found."""
    if file.problem is not None or (file.text is not None and card is None):
        return []  # reported with the files, or its front matter cannot be read (``readings``)
    if file.text is None:
        return [Finding("card", f"no {CARD} model card: merge with mergekit-yaml (without --no-write-model-card)")]
    if card is None or card.metadata is None:
        return [
            Finding(
                "card",
                f"{CARD} has no YAML front matter (between --- lines at its top): merge again with mergekit-yaml",
            )
        ]
    metadata = card.metadata
    license_id, base_model, relation, tags = (
        metadata.get(key) for key in ("license", "base_model", "base_model_relation", "tags")
    )
    listed = base_model if isinstance(base_model, list) else [base_model] if base_model is not None else []
    base_fix = (
        "--hub-id writes it (below)"
        if local
        else "list the merged models' Hub ids under base_model (mergekit lists those of its recipe)"
    )
    checks = [
        (
            "license",
            not license_id,
            "the card's front matter has no license: mergekit-ram check OUT --set-license ID, with an id the "
            "input models' licences allow (apache-2.0, mit, ...)",
        ),
        (
            "license",
            license_id == "other" and not (metadata.get("license_name") and metadata.get("license_link")),
            "the card says license: other without license_name and license_link: add both to its front matter",
        ),
        (
            "base_model",
            not listed,
            f"the card's front matter has no base_model (mergekit lists only Hub ids there): {base_fix}",
        ),
        (
            "base_model",
            any(not isinstance(name, str) or not name for name in listed),
            f"the card's base_model is {shown(base_model)}, not a list of Hub ids: list the merged models' Hub ids",
        ),
        (
            "base_model_relation",
            relation != "merge",
            (
                "the card's front matter has no base_model_relation"
                if relation is None
                else f"the card's front matter has base_model_relation: {shown(relation)}"
            )
            + ": set base_model_relation: merge (the Hub's relation for a merge of the base_model models"
            + ("; --hub-id writes it)" if local else ")"),
        ),
        (
            "tags",
            not (isinstance(tags, list) and MERGE_TAG in tags),
            f"the card's front matter has no tag {MERGE_TAG}: add it under tags (mergekit writes mergekit, "
            f"{MERGE_TAG}; mergekit-ram adds {CARD_TAG})",
        ),
    ]
    found = [Finding(check, message) for check, failed, message in checks if failed]
    if statistics is not None and "## RAM statistics" not in card.body:
        found.append(Finding("card", f"{CARD} has no RAM statistics section", note=True))
    return found


def consistency(card: FolderFile, recipe: FolderFile, read: Readings) -> list[Finding]:
    """Whether the card, the recipe and the statistics describe one merge: a write into the folder while a merge
    published (an earlier ``--set-license``) could leave another merge's card beside the new recipe and statistics."""
    found = []
    block = recipe_block(read.card.body) if read.card is not None else None
    if block is not None and recipe.text is not None and block[2].strip() != recipe.text.strip():
        found.append(f"{CARD} quotes another recipe than {RECIPE}: {ANOTHER_MERGE}")
    if read.card is not None and read.statistics is not None and "## RAM statistics" in read.card.body:
        found += section_differences(read.card.body, statistics_from_dict(read.statistics))
    recipe_paths = None if read.references is None else {p for r in read.references for p in r.paths}
    if recipe_paths is not None and read.statistics is not None:
        counted = [name for name in statistics_models(read.statistics) if set(reference_paths(name)) - recipe_paths]
        if counted:
            found.append(f"{STATISTICS_FILE} counts models {RECIPE} does not merge ({', '.join(counted)}): merge again")
        method = _recipe_method(recipe.text)
        if method is not None and method != read.statistics.get("method"):
            found.append(
                f"{STATISTICS_FILE} is of a {read.statistics.get('method')} merge, {RECIPE} of {method}: merge again"
            )
    if recipe_paths is not None and read.card is not None and read.card.metadata is not None:
        listed = read.card.metadata.get("base_model")
        listed = [name for name in (listed if isinstance(listed, list) else [listed]) if isinstance(name, str)]
        for name in [name for name in listed if name not in recipe_paths and not is_local(name)]:
            found.append(f"the card's base_model lists {name}, which {RECIPE} does not merge: {ANOTHER_MERGE}")
        hub_models = sorted(path for path in recipe_paths if not is_local(path) and path not in listed)
        if hub_models and listed:
            found.append(
                f"the card's base_model does not list {', '.join(hub_models)}, which {RECIPE} merges: add "
                f"{'it' if len(hub_models) == 1 else 'them'} (mergekit lists every Hub model of its recipe)"
            )
    return [Finding("consistency", message) for message in found]


def section_differences(body: str, statistics: Any) -> list[str]:
    """The card's RAM statistics (settings line, table) against those the statistics file makes."""
    expected = card_markdown(statistics)
    found = []
    settings, wanted = _SETTINGS_LINE.search(body), _SETTINGS_LINE.search(expected)
    if wanted is not None and (settings is None or settings.groups() != wanted.groups()):
        described = f"a {settings[1]} merge with {settings[2]}" if settings is not None else "no settings"
        found.append(
            f"{CARD}'s RAM statistics describe {described}, {STATISTICS_FILE} a {wanted[1]} merge with {wanted[2]}: "
            + ANOTHER_MERGE
        )
    table, expected_table = _statistics_table(body), _statistics_table(expected)
    models, expected_models = [row[0] for row in table], [row[0] for row in expected_table]
    if models != expected_models:
        found.append(
            f"{CARD}'s RAM statistics list {', '.join(models) or 'no models'}, {STATISTICS_FILE} "
            f"{', '.join(expected_models)}: {ANOTHER_MERGE}"
        )
    elif table != expected_table:
        differing = [row[0] for row, other in zip(table, expected_table) if row != other]
        found.append(
            f"{CARD}'s RAM statistics give other figures than {STATISTICS_FILE} for {', '.join(differing)}: "
            + ANOTHER_MERGE
        )
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
        documents = bounded_yaml.load(text or "", RECIPE)
        if len(documents) == 1 and isinstance(documents[0], dict) and isinstance(documents[0].get("merge_method"), str):
            return documents[0]["merge_method"]
    return None


def local_paths(read: Readings, local: list[str]) -> list[Finding]:
    """The naming files that name local folders (readers of the card cannot find those models), with the step
    that names them by their Hub ids."""
    if not local:
        return []
    named = {
        RECIPE: [path for r in read.references or [] for path in r.paths if path in local],
        STATISTICS_FILE: [
            path for name in statistics_models(read.statistics) for path in reference_paths(name) if path in local
        ]
        + mentions(" ".join(w for w in (read.statistics or {}).get("warnings") or [] if isinstance(w, str)), local),
        CARD: [],
    }
    if read.card is not None:
        listed = (read.card.metadata or {}).get("base_model")
        named[CARD] = [p for p in (listed if isinstance(listed, list) else [listed]) if p in local]
        named[CARD] += mentions(read.card.body, local)
    files = [name for name in NAMING_FILES if named[name]]
    paths = sorted({path for name in files for path in named[name]})
    if not files:
        return []
    named_by = files[0] + " names" if len(files) == 1 else f"{', '.join(files[:-1])} and {files[-1]} name"
    message = f"{named_by} local folders ({', '.join(paths)}): {HUB_ID_FIX.format(path=paths[0])}"
    return [Finding("local_paths", message)]
