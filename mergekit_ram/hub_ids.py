"""The Hub ids of the local models a merge read, written into its folder: ``mergekit-ram check OUT --hub-id LOCAL=ID``.

Agents trained locally are merged from local folders, so mergekit's card lists no ``base_model`` and the card, the
recipe (``mergekit_config.yml``) and the statistics name paths of one machine. Given each local model's Hub id once,
``prepare_for_hub`` rewrites the three alike: the recipe's model references (parsed; each scalar replaced where the
parser found it, so the user's layout and comments stay), every model name in the statistics (JSON parsed and
dumped as the merge dumps it), and the card (front matter parsed and dumped; mergekit's model lines, the recipe block
and the statistics table by their places, other mentions of a path as whole words), with one line saying which
models were local folders. What is rewritten is what a merge of the Hub ids writes, so a second run changes nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from typing import Any, Iterable, NamedTuple, Optional

import yaml

import mergekit_ram.bounded_yaml as bounded_yaml
from mergekit_ram.errors import MergedFolderError
from mergekit_ram.files import JSON_LIMIT, UnreadableFile, read_regular, write_atomically
from mergekit_ram.published import MODEL_LIST, Card, read_card, with_sorted_model_list
from mergekit_ram.stats.schema import STATISTICS_FILE, statistics_from_dict

CARD, RECIPE = "README.md", "mergekit_config.yml"
#: A Hub model id as ``huggingface_hub.utils.validate_repo_id`` takes it: ``name`` or ``org/name``, each of word
#: characters, ``.`` and ``-``, starting and ending with a word character, at most 96; then ``--``, ``..`` and a
#: final ``.git`` are refused.
_NAME = r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?"
HUB_ID = re.compile(rf"(?:{_NAME}/)?{_NAME}")
#: A git revision after ``@``, as mergekit reads ``org/name@revision``: a branch, tag or commit.
REVISION = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_./-]{0,254}")
#: Keys whose text is a mergekit model reference (``path@revision+lora@revision``) ...
REFERENCE_KEYS = frozenset({"model", "base_model", "tokenizer_source", "source"})
#: ... or one model path (``path@revision``), in a recipe at any depth (mergekit's ``ModelReference``, ``ModelPath``).
PATH_KEYS = frozenset({"lora", "path"})
#: Tokenizer sources that name no model.
SOURCE_WORDS = frozenset({"base", "union"})
#: The line a rewritten card gets; ``{ids}``: the local models' Hub ids.
LOCAL_LINE = (
    "When this model was merged, {ids} were local folders: this card, mergekit_config.yml and ram_statistics.json "
    "name them by their Hub ids."
)
#: mergekit's card: its base model line (``This model was merged using the <method> merge method using <model>
#: as a base.``), and where it quotes the recipe.
_BASE_LINE = ("This model was merged using the ", " merge method using ", " as a base.")
_RECIPE_BLOCK = re.compile(
    r"(^The following YAML configuration was used to produce this model:\n\n```yaml\n)(.*?)(^```$)",
    re.MULTILINE | re.DOTALL,
)
#: Around a path mentioned in text: what may come before and after it (not ``.``: "as a base.").
_BEFORE, _AFTER = r"(?<![^\s(\[|`'\"])", r"(?=[\s)\]|`'\",:;]|$)"
_SHOWN = 5  # local models named in one message at most


def hub_id_problem(hub_id: str) -> Optional[str]:
    """Why ``hub_id`` (``org/name``, optionally ``@revision``) is not a Hub model id; None if it is one."""
    name, _, revision = hub_id.partition("@")
    if not HUB_ID.fullmatch(name) or "--" in name or ".." in name or name.endswith(".git"):
        return f"{name!r} is not a Hub model id (org/name: letters, digits, '_', '.', '-')"
    if "@" in hub_id and not REVISION.fullmatch(revision):
        return f"{revision!r} is not a revision (a branch, tag or commit after @)"
    return None


def parse_hub_id(text: str) -> tuple[str, str]:
    """``LOCAL=ID`` as (LOCAL, ID): split at the last ``=`` (a folder's name may hold one, an id cannot)."""
    local, equals, hub_id = text.rpartition("=")
    if not equals or not local or not hub_id:
        raise ValueError(
            f"{text!r} is not LOCAL=ID (a local model's folder, '=', its Hub id: ./models/coder=org/coder)"
        )
    problem = hub_id_problem(hub_id)
    if problem is not None:
        raise ValueError(f"{text!r}: {problem}")
    return local, hub_id


def read_hub_id_file(path: str) -> list[tuple[str, str]]:
    """A YAML or JSON mapping of local folders to Hub ids (``{./models/coder: org/coder}``), bounded."""
    try:
        text = read_regular(path, bounded_yaml.MAX_CHARACTERS).decode("utf-8")
        mapping = bounded_yaml.load_one(text, path)
    except (OSError, UnreadableFile, UnicodeDecodeError, bounded_yaml.UnreadableYaml) as error:
        reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
        raise ValueError(f"cannot read {path} ({reason})") from None
    if not isinstance(mapping, dict):
        raise ValueError(f"{path} is not a mapping of local model folders to Hub ids ({{./models/coder: org/coder}})")
    pairs = []
    for local, hub_id in mapping.items():
        if not isinstance(local, str) or not isinstance(hub_id, str):
            raise ValueError(f"{path}: every key must be a folder and every value a Hub id, as text")
        pairs.append(parse_hub_id(f"{local}={hub_id}"))
    return pairs


def resolved(path: str) -> str:
    """A path as the user or a recipe wrote it, made absolute from here, links resolved (``A1/`` is ``./A1``)."""
    return os.path.realpath(os.path.expanduser(path))


def checked_hub_ids(pairs: Iterable[tuple[str, str]]) -> dict[str, str]:
    """{resolved LOCAL: ID}; one folder given two ids is refused (``ValueError``)."""
    ids: dict[str, str] = {}
    for local, hub_id in pairs:
        key = resolved(local)
        if ids.setdefault(key, hub_id) != hub_id:
            raise ValueError(f"{local} is given two Hub ids, {ids[key]} and {hub_id}: give it one")
    return ids


def reference_paths(reference: str, whole: bool = True) -> list[str]:
    """The paths of a model reference as mergekit splits it: ``path@revision+lora@revision`` (``whole``), else
    ``path@revision``."""
    return [part.partition("@")[0] for part in (reference.split("+") if whole else [reference])]


def is_local(path: str) -> bool:
    """Not a Hub id, or a folder here: what mergekit reads from the disk (a relative path from the current folder,
    where the merge ran)."""
    return bool(path) and (not HUB_ID.fullmatch(path) or os.path.isdir(path))


def renamed_reference(reference: str, renames: dict[str, str], whole: bool = True) -> str:
    """``reference`` with each renamed path replaced by its Hub id (the local path's revision dropped)."""
    parts = reference.split("+") if whole else [reference]
    return "+".join(renames.get(part.partition("@")[0], part) for part in parts)


def hub_path(hub_id: str) -> str:
    """An id without its revision: what the card's ``base_model`` lists and links."""
    return hub_id.partition("@")[0]


# The recipe --------------------------------------------------------------------------------------------------


class Reference(NamedTuple):
    """A model reference in a recipe: its key and its scalar node."""

    key: str
    node: yaml.ScalarNode

    @property
    def whole(self) -> bool:
        """A whole reference (``path@revision+lora@revision``), else one path."""
        return self.key in REFERENCE_KEYS

    @property
    def paths(self) -> list[str]:
        return reference_paths(self.node.value, self.whole)


def _is_reference(key: yaml.Node, value: yaml.Node) -> bool:
    if not (_is_text(key) and _is_text(value) and key.value in REFERENCE_KEYS | PATH_KEYS):
        return False
    return not (key.value in ("source", "tokenizer_source") and value.value in SOURCE_WORDS)


def recipe_references(documents: list[yaml.Node]) -> list[Reference]:
    """Every model reference of the recipe's documents, at any depth, in the text's order; a node that aliases
    name twice, once."""
    found: dict[int, Reference] = {}
    seen, stack = set(), list(documents)
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            stack.extend(node.value)
        elif isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                if _is_reference(key, value):
                    found.setdefault(id(value), Reference(key.value, value))
                else:
                    stack.append(value)
    return sorted(found.values(), key=lambda reference: reference.node.start_mark.index)


def _is_text(node: yaml.Node) -> bool:
    return isinstance(node, yaml.ScalarNode) and node.tag == "tag:yaml.org,2002:str"


def renamed_recipe(text: str, renames: dict[str, str]) -> str:
    """The recipe's text with its references renamed where the parser found them; if the result does not read
    back as the renamed recipe (an alias shared with another key), the renamed recipe dumped instead."""
    references = [r for r in recipe_references(bounded_yaml.compose(text, RECIPE)) if set(r.paths) & set(renames)]
    if not references:
        return text
    pieces, done = [], 0
    for reference in references:
        start, end = reference.node.start_mark.index, reference.node.end_mark.index
        raw = text[start:end]
        properties = re.match(r"(?:[&!]\S*\s+)*", raw)
        assert properties is not None
        new = renamed_reference(reference.node.value, renames, reference.whole)
        if reference.key == "path" and "@" in new:
            raise MergedFolderError(
                f"{RECIPE} names {reference.node.value} as a path beside its revision: give its Hub id without "
                f"@revision, and write the revision into the recipe's revision field"
            )
        pieces += [text[done:start], properties[0], _scalar(new, reference.node.style)]
        done = end
    spliced = "".join(pieces) + text[done:]
    expected = [_renamed_value(document, renames) for document in bounded_yaml.load(text, RECIPE)]
    with contextlib.suppress(bounded_yaml.UnreadableYaml):
        if bounded_yaml.load(spliced, RECIPE) == expected:
            return spliced
    return yaml.safe_dump_all(expected, sort_keys=False, allow_unicode=True)


def _scalar(value: str, style: Optional[str]) -> str:
    """``value`` as a YAML scalar in the original's style where that reads back as the same text."""
    if style == "'":
        return "'" + value.replace("'", "''") + "'"
    if style is None and re.fullmatch(r"[A-Za-z0-9_~./][A-Za-z0-9_./@+-]*", value):
        with contextlib.suppress(bounded_yaml.UnreadableYaml):
            if bounded_yaml.load(value, "a model id") == [value]:
                return value
    return json.dumps(value)  # a double-quoted YAML scalar


def _renamed_value(value: Any, renames: dict[str, str], key: Any = None) -> Any:
    """A constructed recipe with its references renamed (what the spliced text must read back as)."""
    if isinstance(value, dict):
        return {k: _renamed_value(v, renames, k) for k, v in value.items()}
    if isinstance(value, list):
        return [_renamed_value(v, renames) for v in value]
    if isinstance(value, str) and key in REFERENCE_KEYS | PATH_KEYS:
        if key in ("source", "tokenizer_source") and value in SOURCE_WORDS:
            return value
        return renamed_reference(value, renames, key in REFERENCE_KEYS)
    return value


# The statistics ----------------------------------------------------------------------------------------------


def statistics_models(data: Any) -> list[str]:
    """The model names a statistics file holds (each model's row, each tensor's list), where well typed."""
    if not isinstance(data, dict):
        return []
    names = [row.get("model") for row in _list(data.get("models")) if isinstance(row, dict)]
    names += [
        name for entry in _list(data.get("tensors")) if isinstance(entry, dict) for name in _list(entry.get("models"))
    ]
    return list(dict.fromkeys(name for name in names if isinstance(name, str)))


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def renamed_statistics(data: Any, renames: dict[str, str]) -> Any:
    """Every text that is a model name renamed (keys too); in ``warnings``, each path mentioned."""
    if isinstance(data, dict):
        return {
            _renamed_text(key, renames): (
                [renamed_mentions(w, renames) if isinstance(w, str) else w for w in value]
                if key == "warnings" and isinstance(value, list)
                else renamed_statistics(value, renames)
            )
            for key, value in data.items()
        }
    if isinstance(data, list):
        return [renamed_statistics(value, renames) for value in data]
    return _renamed_text(data, renames)


def _renamed_text(value: Any, renames: dict[str, str]) -> Any:
    return renamed_reference(value, renames) if isinstance(value, str) else value


def statistics_text(data: Any) -> str:
    """As the merge writes the file (``mergekit_ram.stats.schema.statistics_to_json``)."""
    return json.dumps(data, indent=2, allow_nan=False) + "\n"


# The card ----------------------------------------------------------------------------------------------------


def mentions(text: str, paths: Iterable[str]) -> list[str]:
    """The ``paths`` that ``text`` mentions as whole words (not inside a longer path or a word)."""
    return [path for path in paths if re.search(_BEFORE + re.escape(path) + _AFTER, text)]


def renamed_mentions(text: str, renames: dict[str, str]) -> str:
    """Each whole-word mention of a renamed path replaced by its Hub id (longest paths first)."""
    if not renames:
        return text
    paths = "|".join(re.escape(path) for path in sorted(renames, key=len, reverse=True))
    return re.sub(f"{_BEFORE}(?:{paths}){_AFTER}", lambda found: renames[found[0]], text)


def recipe_block(body: str) -> Optional[re.Match[str]]:
    """Where mergekit's card quotes the recipe: its group 2 is the recipe's text (and a line end)."""
    return _RECIPE_BLOCK.search(body)


def _linked(markdown: str, renames: dict[str, str]) -> str:
    """mergekit's model text (``path``, or ``path + lora``) with renamed paths as it writes Hub ids: linked."""
    parts = markdown.split(" + ")
    return " + ".join(
        f"[{hub_path(renames[part])}](https://huggingface.co/{hub_path(renames[part])})" if part in renames else part
        for part in parts
    )


def renamed_body(body: str, renames: dict[str, str]) -> str:
    """The card's text after its front matter, renamed: the recipe it quotes as the recipe file is (``renamed_recipe``;
    word by word where it does not parse), mergekit's model lines linking the Hub ids, other mentions the ids."""
    block = recipe_block(body)
    if block is None:
        return with_sorted_model_list(_renamed_text_of_card(body, renames))
    try:
        quoted = renamed_recipe(block[2], renames)
    except bounded_yaml.UnreadableYaml:
        quoted = renamed_mentions(block[2], renames)
    before, after = body[: block.start(2)], body[block.end(2) :]
    return with_sorted_model_list(
        _renamed_text_of_card(before, renames) + quoted + _renamed_text_of_card(after, renames)
    )


def _renamed_text_of_card(text: str, renames: dict[str, str]) -> str:
    text = "".join(_with_linked_base(line, renames) for line in text.splitlines(True))
    text = MODEL_LIST.sub(
        lambda found: (
            found[1]
            + "".join(f"* {_linked(line[2:].rstrip(chr(10)), renames)}\n" for line in found[2].splitlines(True))
        ),
        text,
    )
    return renamed_mentions(text, renames)


def _with_linked_base(line: str, renames: dict[str, str]) -> str:
    """mergekit's base model line with the base linked (found by plain string search: linear in the line)."""
    start, middle, end = _BASE_LINE
    body = line.rstrip("\r\n")
    where = body.find(middle)
    if not (body.startswith(start) and body.endswith(end)) or where < 0:
        return line
    cut = where + len(middle)
    return body[:cut] + _linked(body[cut : len(body) - len(end)], renames) + end + line[len(body) :]


def quoted_references(card: Optional[Card]) -> list[Reference]:
    """The model references of the recipe the card quotes (none where it quotes none, or one that does not parse)."""
    block = recipe_block(card.body) if card is not None else None
    with contextlib.suppress(bounded_yaml.UnreadableYaml):
        return recipe_references(bounded_yaml.compose(block[2], RECIPE)) if block is not None else []
    return []


def with_local_line(body: str, hub_ids: list[str]) -> str:
    """``LOCAL_LINE`` after mergekit's list of the models merged (else before the plugin's section, or last)."""
    line = LOCAL_LINE.format(ids=", ".join(hub_ids))
    listed = MODEL_LIST.search(body)
    if listed is not None:
        return body[: listed.end()] + "\n" + line + "\n" + body[listed.end() :]
    section = body.find("\n## Reproducing this merge\n")
    if section >= 0:
        return body[: section + 1] + line + "\n" + body[section:]
    return body + ("" if body.endswith("\n") or not body else "\n") + "\n" + line + "\n"


def hub_metadata(metadata: dict[str, Any], renames: dict[str, str]) -> dict[str, Any]:
    """``base_model``: the Hub ids it listed and the renamed models', sorted; ``base_model_relation: merge``."""
    listed = metadata.get("base_model")
    listed = listed if isinstance(listed, list) else ([] if listed is None else [listed])
    kept = [str(name) for name in listed if isinstance(name, str) and not is_local(name) and name not in renames]
    base_model = sorted(dict.fromkeys([*kept, *map(hub_path, renames.values())]))
    return {**metadata, "base_model": base_model, "base_model_relation": "merge"} if base_model else metadata


# The folder --------------------------------------------------------------------------------------------------


class FolderText(NamedTuple):
    """The three files that name the models, as read (None: absent)."""

    card: Optional[str]
    recipe: Optional[str]
    statistics: Optional[str]


def read_texts(folder: int, out: str) -> FolderText:
    """Regular files of the folder, bounded, UTF-8; anything else refused in one line."""
    texts: list[Optional[str]] = []
    for name in (CARD, RECIPE, STATISTICS_FILE):
        try:
            texts.append(read_regular(name, JSON_LIMIT, dir_fd=folder, follow_symlinks=False).decode("utf-8"))
        except FileNotFoundError:
            texts.append(None)
        except (OSError, UnreadableFile, UnicodeDecodeError) as error:
            reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
            raise MergedFolderError(f"cannot read {out}/{name} ({reason}): replace it with the merge's own") from None
    return FolderText(*texts)


class Parsed(NamedTuple):
    card: Optional[Card]
    recipe: list[Reference]
    statistics: Any
    quoted: list[Reference] = []  # the card's recipe's


def parsed(texts: FolderText, out: str) -> Parsed:
    """The files parsed as strangers' (bounded); one that cannot be is refused in one line."""
    try:
        card = read_card(texts.card) if texts.card is not None else None
        recipe = recipe_references(bounded_yaml.compose(texts.recipe, RECIPE)) if texts.recipe is not None else []
    except bounded_yaml.UnreadableYaml as error:
        raise MergedFolderError(f"cannot change {out}: {error}; fix it by hand or merge again") from None
    statistics = strict_json(texts.statistics) if texts.statistics is not None else None
    if texts.statistics is not None and not readable_statistics(statistics):
        raise MergedFolderError(
            f"cannot change {out}: {STATISTICS_FILE} is not the statistics a merge writes: merge again"
        )
    return Parsed(card, recipe, statistics, quoted_references(card))


def strict_json(text: str) -> Any:
    """The JSON (None where it is not JSON; NaN and Infinity, which the merge never writes, refused)."""
    with contextlib.suppress(ValueError, RecursionError):
        return json.loads(text, parse_constant=_no_constant)
    return None


def _no_constant(name: str) -> None:
    raise ValueError(name)


def readable_statistics(data: Any) -> bool:
    """Whether the statistics file's reader (``statistics_from_dict``) takes ``data``."""
    try:
        statistics_from_dict(data)
    except Exception:  # whatever a stranger's file makes the reader raise: it does not take it
        return False
    return True


def folder_paths(files: Parsed) -> list[list[str]]:
    """The model paths each place of the folder names: the recipe, the recipe the card quotes, the statistics, the
    card's ``base_model``."""
    listed = (files.card.metadata or {}).get("base_model") if files.card is not None else None
    return [
        [path for reference in files.recipe for path in reference.paths],
        [path for reference in files.quoted for path in reference.paths],
        [path for name in statistics_models(files.statistics) for path in reference_paths(name)],
        [name for name in (listed if isinstance(listed, list) else [listed]) if isinstance(name, str)],
    ]


def all_paths(places: list[list[str]]) -> list[str]:
    """Each path of ``folder_paths`` once, in order."""
    return list(dict.fromkeys(path for paths in places for path in paths if path))


def renames_for(places: list[list[str]], hub_ids: dict[str, str], out: str) -> dict[str, str]:
    """{path as the folder names it: Hub id} for each local path; refused in one line where a local model has no
    id, an id names no model of the folder, or one place (the recipe, say) would name two models by one id."""
    paths = all_paths(places)
    renames = {path: hub_ids[resolved(path)] for path in paths if resolved(path) in hub_ids}
    missing = [path for path in paths if is_local(path) and path not in renames]
    if missing:
        shown = ", ".join(missing[:_SHOWN]) + (f" and {len(missing) - _SHOWN} more" if len(missing) > _SHOWN else "")
        raise MergedFolderError(
            f"{out} names local models without a Hub id: {shown}; give each one: --hub-id {missing[0]}=ORG/NAME "
            "(or a --hub-id-file of them all); nothing was changed"
        )
    named = {hub_path(renames.get(path, path)) for path in paths}
    for local, hub_id in hub_ids.items():
        if hub_id not in renames.values() and hub_path(hub_id) not in named:  # else applied by an earlier run
            raise MergedFolderError(
                f"--hub-id {local}={hub_id}: {out} names no model at {local} (its local models: "
                f"{', '.join(path for path in paths if is_local(path)) or 'none'}); nothing was changed"
            )
    for place in places:
        owners: dict[str, str] = {}
        for path in place:
            other = owners.setdefault(renames.get(path, path), path)
            if resolved(other) != resolved(path):
                raise MergedFolderError(
                    f"{other} and {path} would both be named {renames.get(path, path)}: give each model its own Hub "
                    "id; nothing was changed"
                )
    return renames


def prepared_texts(texts: FolderText, out: str, hub_ids: dict[str, str], license_id: Optional[str]) -> FolderText:
    """The three files as the Hub ids and the licence make them (None: unchanged or absent)."""
    files = parsed(texts, out)
    renames = renames_for(folder_paths(files), hub_ids, out) if hub_ids else {}
    recipe = renamed_recipe(texts.recipe, renames) if texts.recipe is not None else None
    statistics = None
    if files.statistics is not None:
        renamed = renamed_statistics(files.statistics, renames)
        if not readable_statistics(renamed):
            raise MergedFolderError(f"renaming the models of {out}/{STATISTICS_FILE} breaks it: report it as a bug")
        statistics = statistics_text(renamed) if renamed != files.statistics else None
    card = None
    if texts.card is not None and files.card is not None and (renames or license_id is not None):
        body = files.card.body  # as it is, for the licence alone
        if renames:
            body = with_local_line(renamed_body(body, renames), sorted({hub_path(h) for h in renames.values()}))
        metadata = hub_metadata(dict(files.card.metadata or {}), renames) if renames else files.card.metadata
        if license_id is not None:
            metadata = {**(metadata or {}), "license": license_id}
        new_card = files.card._replace(metadata=metadata, body=body).text()
        card = new_card if new_card != texts.card else None
    elif license_id is not None:
        raise MergedFolderError(
            f"cannot set the licence of {out}: there is no {CARD} (merge with mergekit-yaml, which writes the card)"
        )
    return FolderText(card, recipe if recipe != texts.recipe else None, statistics)


def prepare_for_hub(out: str, pairs: list[tuple[str, str]], license_id: Optional[str]) -> list[str]:
    """Under the merge's own lock (``staging.folder_writer``): the Hub ids and the licence written; the names of
    the files changed. Everything is checked before the first write; each write is one rename, statistics and
    recipe before the card, so a run stopped half-way is completed by running it again."""
    from mergekit_ram.staging import folder_writer

    try:
        hub_ids = checked_hub_ids(pairs)
    except ValueError as error:
        raise MergedFolderError(str(error)) from None
    with folder_writer(out) as folder:
        new = prepared_texts(read_texts(folder, out), out, hub_ids, license_id)
        changed: list[str] = []
        for name, text in zip((STATISTICS_FILE, RECIPE, CARD), (new.statistics, new.recipe, new.card)):
            if text is None:
                continue
            try:
                write_atomically(name, text, dir_fd=folder)
            except OSError as error:
                done = f" ({', '.join(changed)} already rewritten: run it again once fixed)" if changed else ""
                raise MergedFolderError(
                    f"cannot write {name} in {out} ({error.strerror or error}){done}: check that you may write there"
                ) from None
            changed.append(name)
    return changed
