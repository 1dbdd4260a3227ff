"""The documentation cannot drift from the code it describes.

- Every message the package can raise, warn, log or build as an error (its fixed text) is quoted in
  docs/reliability.md: adding a ``raise`` without documenting it fails here; and every
  message that page quotes as the plugin's is one the code gives (rewording one fails here).
- The versions and the statistics schema the pages name, and how they say an infinite rho is
  written, are the code's.
- README.md's parameters table lists each parameter with the methods that declare it and their defaults;
  its recipe is the shipped recipe it names, field for field.
- Every test, script and module a page names exists; every link into the repository resolves
  (README.md's are absolute, for the package index, and mapped back to the checkout); every
  ``docs/*.md`` page the code, scripts, tests and recipes name exists.
- docs/contributing.md has a line for every module.
"""

from __future__ import annotations

import ast
import glob
import json
import math
import os
import re
from dataclasses import dataclass

import pytest
import yaml

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

from mergekit_ram import __version__
from mergekit_ram.integration.internals import TESTED_MERGEKIT
from mergekit_ram.parameters import METHOD_NAMES
from mergekit_ram.rescaling import RULES
from mergekit_ram.stats.schema import SCHEMA_VERSION, write_ratio

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
PACKAGE = os.path.join(ROOT, "mergekit_ram")
DOCS = os.path.join(ROOT, "docs")
PAGES = ("method.md", "reliability.md", "contributing.md", "performance.md", "quality.md")
#: The page that quotes every message of the package, with its cause and fix.
MESSAGES_PAGE = "reliability.md"
# Pages whose links are checked, relative to the repository root.
LINKED_PAGES = ("README.md", *(f"docs/{page}" for page in PAGES), "recipes/README.md")
# README.md's links point here (absolute, so they work on the package index); mapped back to the checkout.
REPOSITORY = "https://github.com/mergekit-ram/mergekit-ram"
_LOGGING = {"warning", "error", "critical", "exception"}
_PRINTF = re.compile(r"%[-#0 +]*\d*(?:\.\d+)?[sdrifgxX]")


@dataclass(frozen=True)
class Message:
    where: str  # file:line
    kind: str
    fragments: tuple[str, ...]  # the fixed parts a reader would search for


def _pieces(node: ast.AST) -> list[str] | None:
    """The fixed text of a string expression, split where values are interpolated."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        parts, current = [], ""
        for value in node.values:
            if isinstance(value, ast.Constant):
                current += value.value
            else:
                parts.append(current)
                current = ""
        return [*parts, current]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _pieces(node.left), _pieces(node.right)
        if left is None or right is None:
            return None
        return [*left[:-1], left[-1] + right[0], *right[1:]]
    return None


def _fragments(pieces: list[str]) -> tuple[str, ...]:
    """Fixed parts with at least four letters or digits, whitespace-trimmed, one per line."""
    found = []
    for piece in pieces:
        for part in _PRINTF.split(piece):
            for line in part.splitlines():
                line = line.strip()
                if sum(character.isalnum() for character in line) >= 4:
                    found.append(line)
    return tuple(found)


def _message_call(node: ast.AST, function: str | None, klass: str | None) -> tuple[str, ast.Call] | None:
    """(kind, call) when ``node`` produces a message a user can see."""
    if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
        return f"raise {ast.unparse(node.exc.func)}", node.exc
    if isinstance(node, ast.Return) and isinstance(node.value, ast.Call):  # an error built for a raise elsewhere
        name = ast.unparse(node.value.func)
        return (f"return {name}", node.value) if name.endswith("Error") else None
    if not isinstance(node, ast.Call):
        return None
    name = ast.unparse(node.func)
    if name == "warnings.warn":
        return name, node
    if isinstance(node.func, ast.Attribute) and node.func.attr in _LOGGING and name.split(".")[0] in ("LOG", "logger"):
        return name, node
    if function == "_warnings" and name == "found.append":  # the statistics warnings
        return "statistics warning", node
    if name == "super().__init__" and klass is not None and klass.endswith("Error"):
        return f"{klass} message", node
    return None


def collect_messages(source: str, filename: str) -> list[Message]:
    messages = []

    def visit(node: ast.AST, function: str | None, klass: str | None) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = node.name
        elif isinstance(node, ast.ClassDef):
            klass = node.name
        found = _message_call(node, function, klass)
        if found is not None and found[1].args:
            pieces = _pieces(found[1].args[0])
            if pieces is not None:
                messages.append(Message(f"{filename}:{node.lineno}", found[0], _fragments(pieces)))
        for child in ast.iter_child_nodes(node):
            visit(child, function, klass)

    visit(ast.parse(source), None, None)
    return messages


def package_modules() -> list[str]:
    """Every module of the package, subpackages included, relative to it (``stats/render.py``)."""
    paths = glob.glob(os.path.join(PACKAGE, "**", "*.py"), recursive=True)
    return sorted(os.path.relpath(path, PACKAGE).replace(os.sep, "/") for path in paths)


def package_messages() -> list[Message]:
    messages = []
    for module in package_modules():
        with open(os.path.join(PACKAGE, module), encoding="utf-8") as handle:
            messages += collect_messages(handle.read(), f"mergekit_ram/{module}")
    return messages


def read(page: str) -> str:
    with open(os.path.join(DOCS, page), encoding="utf-8") as handle:
        return handle.read()


def undocumented(messages: list[Message], doc: str) -> list[str]:
    doc = doc.replace("\\|", "|")  # pipes escaped inside Markdown tables
    return [f"{m.where} ({m.kind}): {fragment!r}" for m in messages for fragment in m.fragments if fragment not in doc]


def test_every_message_of_the_package_is_documented() -> None:
    messages = package_messages()
    assert len([m for m in messages if m.fragments]) >= 40, "the collector finds too few messages"
    missing = undocumented(messages, read(MESSAGES_PAGE))
    assert not missing, f"docs/{MESSAGES_PAGE} does not quote:\n" + "\n".join(missing)


def test_a_new_undocumented_raise_is_caught() -> None:
    source = (
        "import logging\nLOG = logging.getLogger(__name__)\n"
        "def f(x):\n"
        "    LOG.warning('mergekit-ram: %s looks odd today', x)\n"
        "    raise ValueError(f'a brand new failure {x} nobody wrote down')\n"
        "def g(x):\n"
        "    return InputError(f'{x} was built for a raise elsewhere')\n"
    )
    missing = undocumented(collect_messages(source, "new.py"), read(MESSAGES_PAGE))
    assert missing == [
        "new.py:4 (LOG.warning): 'looks odd today'",
        "new.py:5 (raise ValueError): 'a brand new failure'",
        "new.py:5 (raise ValueError): 'nobody wrote down'",
        "new.py:7 (return InputError): 'was built for a raise elsewhere'",
    ]


def _template(node: ast.AST) -> list[str] | None:
    """The fixed text of a string expression, split where values go in (``_pieces``, with a value that
    is not a string, such as a conditional, taken as one more value of a ``+``)."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _template(node.left), _template(node.right)
        if left is None and right is None:
            return None
        left, right = left or ["", ""], right or ["", ""]
        return [*left[:-1], left[-1] + right[0], *right[1:]]
    return _pieces(node)


def code_templates() -> list[re.Pattern[str]]:
    """Every text the package can put into a message, as a pattern: its fixed parts (at least 8 letters
    or digits in all, ends trimmed), anything where values go in (f-string fields, ``%s``, ``+ value``)."""
    found = set()
    for module in package_modules():
        with open(os.path.join(PACKAGE, module), encoding="utf-8") as handle:
            tree = ast.parse(handle.read())
        for node in ast.walk(tree):
            pieces = _template(node) if isinstance(node, (ast.Constant, ast.JoinedStr, ast.BinOp)) else None
            if pieces is None or sum(character.isalnum() for character in "".join(pieces)) < 8:
                continue
            parts = [part for piece in pieces for part in _PRINTF.split(piece)]
            parts[0] = parts[0].lstrip(_TRIMMED)
            parts[-1] = parts[-1].rstrip(_TRIMMED)
            # a value first or last takes the message's start or end, whatever it is
            found.add("^" * (parts[0] == "") + ".*?".join(map(re.escape, parts)) + "$" * (parts[-1] == ""))
    return [re.compile(pattern, re.DOTALL) for pattern in sorted(found)]


_TRIMMED = " .:;,"
#: What a placeholder of a quoted message, or the punctuation around it, may be.
_PLACEHOLDERS = re.compile(r"(?:<[^<>]*>|[\s.:;,()'\[\]])*")


def quoted_messages(page: str) -> list[str]:
    """The messages the tables of ``page`` headed ``| message |`` quote as mergekit-ram's (the first
    column, without mergekit's own and Python's), each whole: ``... rest`` after a message stands for
    its start, ``start ...`` for its end, and click's ``Error: `` is left out."""
    quoted = []
    header = ""
    for row in read(page).replace("\\|", "|").splitlines():
        if not row.startswith("|"):
            header = ""
            continue
        if not header:
            header = row
            continue
        cell = row.split(" | ")[0][2:] if row.startswith("| ") and header.startswith("| message |") else ""
        if "(mergekit's)" in cell or "(not a message)" in cell or re.match(r"`?[A-Z]\w+(Error|Warning):", cell):
            continue
        previous = ""
        for double, single in re.findall(r"``(.+?)``|`([^`]+)`", cell):
            span = (double or single).strip().removeprefix("Error: ")
            if len(span.split()) < 3 or span.startswith("-"):
                continue
            if span.startswith("...") and previous:
                rest = span[3:].lstrip()
                span = previous[: max(previous.find(rest.split()[0]), 0)] + rest
            if span.endswith("...") and previous:
                rest = span[:-3].rstrip()
                span = rest + previous[previous.find(rest.split()[-1]) + len(rest.split()[-1]) :]
            previous = span.strip(_TRIMMED)
            quoted.append(previous)
    return quoted


def unexplained(messages: list[str], templates: list[re.Pattern[str]]) -> list[str]:
    """The messages no single text of the code produces: some template must match the message, all but
    placeholders (``<model>``) and punctuation around them."""

    def explained(message: str) -> bool:
        for template in templates:
            found = template.search(message)
            if found and all(
                _PLACEHOLDERS.fullmatch(part) for part in (message[: found.start()], message[found.end() :])
            ):
                return True
        return False

    return [message for message in messages if not explained(message)]


def test_every_quoted_message_is_one_the_code_gives() -> None:
    quoted = quoted_messages(MESSAGES_PAGE)
    assert len(quoted) >= 100, "the reader finds too few quoted messages"
    missing = unexplained(quoted, code_templates())
    assert not missing, f"docs/{MESSAGES_PAGE} quotes messages the code does not give:\n" + "\n".join(missing)


def test_a_reworded_message_is_caught() -> None:
    templates = code_templates()
    assert (
        unexplained(["model path <path> does not exist", "<model>: tensor <tensor> contains NaN or Inf"], templates)
        == []
    )
    assert unexplained(["model path <path> is missing", "the model path <path> does not exist"], templates) == [
        "model path <path> is missing",
        "the model path <path> does not exist",
    ]


def _anchor(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def sdist_leaves_out(root: str = ROOT) -> tuple[str, ...]:
    """The folders pyproject.toml keeps out of the sdist (results, images), relative to the root."""
    with open(os.path.join(root, "pyproject.toml"), "rb") as handle:
        sdist = tomllib.load(handle)["tool"]["hatch"]["build"]["targets"]["sdist"]
    return tuple(path.strip("/") for path in sdist["exclude"])


def link_targets(text: str) -> list[str]:
    """Targets of inline links ``[text](target)`` and of reference definitions ``[label]: target``."""
    inline = re.findall(r"\]\(([^)\s]+)\)", text)
    return inline + re.findall(r"^\[[^\]]+\]:\s*(\S+)", text, flags=re.MULTILINE)


def local_target(target: str, page: str, root: str) -> tuple[str | None, str]:
    """(local path or None for another site, anchor) of a link on ``page`` (relative to root).

    Links to this repository's files (``REPOSITORY/blob/main/PATH``, ``.../tree/main/PATH``)
    map back to the checkout, so they are checked like relative ones.
    """
    address, _, anchor = target.partition("#")
    match = re.match(rf"{re.escape(REPOSITORY)}/(?:blob|tree)/main/(.*)", address)
    if match:
        return os.path.join(root, match.group(1)), anchor
    if re.match(r"[a-z]+://", address) or address.startswith("mailto:"):
        return None, anchor
    if not address:
        return os.path.join(root, page), anchor
    return os.path.normpath(os.path.join(root, os.path.dirname(page), address)), anchor


def link_problems(page: str, root: str = ROOT) -> list[str]:
    """Links, named tests and scripts of ``page`` (a path relative to ``root``) that do not resolve.

    README.md is also the project's page on the package index, where relative links are dead:
    its links must be absolute. In an unpacked sdist, links into what the sdist leaves out pass.
    """
    with open(os.path.join(root, page), encoding="utf-8") as handle:
        text = handle.read()
    problems = []
    definitions = set(re.findall(r"^\[([^\]]+)\]:", text, flags=re.MULTILINE))
    for label in re.findall(r"\]\[([^\]]+)\]", text):
        if label not in definitions:
            problems.append(f"link [{label}]: no definition")
    left_out = sdist_leaves_out(root) if os.path.exists(os.path.join(root, "PKG-INFO")) else ()
    for target in link_targets(text):
        if page == "README.md" and not re.match(r"[a-z]+:", target) and not target.startswith("#"):
            problems.append(f"link {target}: relative, dead on the package index (use {REPOSITORY}/blob/main/...)")
            continue
        resolved, anchor = local_target(target, page, root)
        if resolved is None:
            continue
        if not os.path.exists(resolved):
            if os.path.relpath(resolved, root).startswith(tuple(f"{path}/" for path in left_out)):
                continue
            problems.append(f"link {target}: no such file")
            continue
        if anchor and resolved.endswith(".md"):
            with open(resolved, encoding="utf-8") as handle:
                headings = re.findall(r"^#+ (.+)$", handle.read(), flags=re.MULTILINE)
            if anchor not in {_anchor(heading) for heading in headings}:
                problems.append(f"link {target}: no such heading")
    for file, name in re.findall(r"(tests/\w+\.py)::(\w+)", text):
        with open(os.path.join(root, file), encoding="utf-8") as handle:
            if not re.search(rf"^def {name}\(", handle.read(), flags=re.MULTILINE):
                problems.append(f"{file}::{name}: no such test")
    for file in set(re.findall(r"\b((?:docs/scripts|mergekit_ram|tests|benchmarks)/(?:\w+/)*\w+\.py)\b", text)):
        if not os.path.exists(os.path.join(root, file)):
            problems.append(f"{file}: no such file")
    return problems


@pytest.mark.parametrize("page", LINKED_PAGES)
def test_links_and_references_resolve(page: str) -> None:
    problems = link_problems(page)
    assert not problems, f"{page}:\n" + "\n".join(problems)


def test_readme_links_are_absolute_and_checked(tmp_path) -> None:
    """A relative link, a repository link to a missing file and an undefined label all fail."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "method.md").write_text("# The method\n", encoding="utf-8")
    (tmp_path / "README.md").write_text(
        f"[ok]({REPOSITORY}/blob/main/docs/method.md#the-method) [rel](docs/method.md) [gone][g] [nolabel][x]\n"
        f"[web](https://arxiv.org/abs/2601.13572) [bad anchor]({REPOSITORY}/blob/main/docs/method.md#nope)\n\n"
        f"[g]: {REPOSITORY}/tree/main/recipes\n",
        encoding="utf-8",
    )
    assert link_problems("README.md", str(tmp_path)) == [
        "link [x]: no definition",
        f"link docs/method.md: relative, dead on the package index (use {REPOSITORY}/blob/main/...)",
        f"link {REPOSITORY}/blob/main/docs/method.md#nope: no such heading",
        f"link {REPOSITORY}/tree/main/recipes: no such file",
    ]


def test_contributing_describes_every_module() -> None:
    text = read("contributing.md")
    missing = [module for module in package_modules() if f"`{module}`" not in text]
    assert not missing, f"docs/contributing.md has no line for {missing}"


#: Where the package, its scripts, tests and recipes may name a page of the documentation.
NAMING_PAGES = ("mergekit_ram", "docs/scripts", "tests", "recipes", "benchmarks", "Makefile", "pyproject.toml")


def named_pages(root: str = ROOT) -> dict[str, set[str]]:
    """``docs/<page>.md`` named in the files under ``NAMING_PAGES`` -> the files that name it."""
    named: dict[str, set[str]] = {}
    for entry in NAMING_PAGES:
        path = os.path.join(root, entry)
        files = [path] if os.path.isfile(path) else glob.glob(os.path.join(path, "**", "*"), recursive=True)
        for file in files:
            if not file.endswith((".py", ".yaml", ".yml", ".md", ".toml", ".txt", "Makefile")):
                continue
            with open(file, encoding="utf-8") as handle:
                for page in re.findall(r"\bdocs/[\w-]+\.md\b", handle.read()):
                    named.setdefault(page, set()).add(os.path.relpath(file, root))
    return named


def test_pages_the_code_names_exist() -> None:
    named = named_pages()
    assert "docs/reliability.md" in named and "docs/method.md" in named, "the reader finds no page names"
    missing = {page: sorted(files) for page, files in named.items() if not os.path.exists(os.path.join(ROOT, page))}
    assert not missing, f"pages named but not in docs/: {missing}"


def readme_parameters(text: str) -> dict[str, tuple[set[str], bool, dict[str, str]]]:
    """README.md's parameters table: name -> (methods, per model, default by method as written)."""
    section = text.split("\n## Methods and parameters\n", 1)[1].split("\n## ", 1)[0]
    found = {}
    for row in section.splitlines():
        cells = [cell.strip() for cell in row.strip().strip("|").split("|")]
        if not row.startswith("| `") or len(cells) != 5:
            continue
        name, methods, default = cells[0].strip("`"), cells[1], cells[2]
        declared = set(METHOD_NAMES) if methods.startswith("all four") else set(re.findall(r"`(ram\w*)`", methods))
        values = {method: default.split(";")[0].strip().strip("`") for method in declared}
        values.update(re.findall(r"`(ram\w*)`: `([^`]+)`", default))
        found[name] = (declared, "per model" in methods, values)
    return found


def test_readme_parameters_are_the_codes() -> None:
    """Each parameter row names exactly the methods that declare it, whether it is set per model, and
    each method's default as the registered method declares it (``none`` for a pin)."""
    from mergekit_ram.integration.recipes import declared, per_model

    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as handle:
        table = readme_parameters(handle.read())
    code: dict[str, tuple[set[str], bool, dict[str, str]]] = {}
    for method in METHOD_NAMES:
        for name, spec in declared(method).items():
            methods, _, defaults = code.setdefault(name, (set(), per_model(spec), {}))
            methods.add(method)
            defaults[method] = "none" if spec.default is None else str(spec.default)
    assert set(table) == set(code), "README.md's parameters table and parameters.py name different parameters"
    for name, (methods, one_per_model, defaults) in code.items():
        documented_methods, documented_per_model, documented = table[name]
        assert (documented_methods, documented_per_model) == (methods, one_per_model), name
        for method, default in defaults.items():
            written = documented[method]
            same = written == default if default in ("none", *RULES) else float(written) == float(default)
            assert same, f"{name} for {method}: README.md says {written}, parameters.py {default}"


def test_readme_recipe_is_the_shipped_one_it_names() -> None:
    """The recipe README.md shows has the fields and values of the file under recipes/ it names."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as handle:
        section = handle.read().split("\n## A recipe\n", 1)[1].split("\n## ", 1)[0]
    (shown,) = re.findall(r"```yaml\n(.*?)```", section, flags=re.DOTALL)
    (named,) = re.findall(r"`(recipes/[\w./-]+\.yaml)`", section)
    with open(os.path.join(ROOT, named), encoding="utf-8") as handle:
        assert yaml.safe_load(shown) == yaml.safe_load(handle)


#: Where a page says how ram_statistics.json writes an infinite rho: (page, pattern of the quoted value).
INFINITE_RHO = (
    ("method.md", r"\| `rho` \| number or `([^`]+)`"),
    ("method.md", r"\| `measured_rho` \| number or `([^`]+)`"),
    ("method.md", r"`local_rho` \(number or `([^`]+)`\)"),
    ("method.md", r"writes the string `([^`]+)`"),
    ("method.md", r"`([^`]+)` in the JSON"),
    ("reliability.md", r"or `([^`]+)` for infinity"),
)


def test_the_documented_infinite_rho_is_what_the_json_holds() -> None:
    written = json.dumps(write_ratio(math.inf))
    assert written == '"inf"'
    for page, pattern in INFINITE_RHO:
        assert re.findall(pattern, read(page)) == [written], f"{page}: {pattern}"


def test_documented_versions_are_the_codes() -> None:
    """method.md's statistics schema (heading, field, table of versions) and the versions of mergekit-ram
    and mergekit the pages name are the ones the code writes and supports."""
    text = read("method.md")
    assert f"## The object (schema {SCHEMA_VERSION})" in text and f"| `schema` | integer | `{SCHEMA_VERSION}`," in text
    start = text.index("### Versions\n")
    end = text.find("\n## ", start)
    versions = text[start:] if end < 0 else text[start:end]
    rows = re.findall(r"^\| (\d+) \| (.+?) \|", versions, flags=re.MULTILINE)
    assert tuple(int(schema) for schema, _ in rows) == (SCHEMA_VERSION,)
    assert f"mergekit-ram {__version__} " in rows[-1][1]
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as handle:
        pages = {"README.md": handle.read(), **{page: read(page) for page in PAGES}}
    pages["method.md"] = text.replace(versions, "")  # the table names the versions of the past
    for page, content in pages.items():
        assert set(re.findall(r"mergekit-ram (\d+\.\d+\.\d+)", content)) <= {__version__}, page
        if page in ("README.md", "method.md", "reliability.md", "contributing.md"):
            # and 0.1.4, the release before the range, which tests/test_moved_mergekit.py runs the plugin beside (off)
            assert set(re.findall(r"\bmergekit (\d+\.\d+\.\d+)", content)) <= {*TESTED_MERGEKIT, "0.1.4"}, page
