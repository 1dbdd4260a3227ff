"""YAML from strangers' folders (a card's front matter, a recipe beside merged weights), read within bounds.

``yaml.safe_load`` has three ways to run away or fail on such text: an alias names a node already read, so nine
levels of ten aliases are 10**9 nodes to whatever walks the result (a 2.5 KB card took 67 s and 1.8 GB to a
``MemoryError``); nesting exhausts the composer's recursion; and a date that is not one (``2024-13-01``) raises a
``ValueError`` that is not a ``yaml.YAMLError``. Here the text is limited in size, nesting and expanded nodes
before anything is constructed, dates stay text, and every refusal is one ``UnreadableYaml`` line naming the
place.
"""

from __future__ import annotations

from typing import Any, Iterator

import yaml

from mergekit_ram.errors import RamError, one_line

#: The longest text read (characters): a card's front matter or a recipe is a few KB.
MAX_CHARACTERS = 1 << 20
#: The deepest nesting (a recipe needs about ten, a front matter three).
MAX_NESTING = 64
#: The most nodes a document may have once every alias is counted as the node it names.
MAX_NODES = 100_000
_TIMESTAMP = "tag:yaml.org,2002:timestamp"


class UnreadableYaml(RamError, ValueError):
    """Text that is not YAML, or that exceeds a bound; the message says which and where."""


class TextDatesLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that reads an unquoted date as the text it is (``2024-02-30`` included)."""


TextDatesLoader.yaml_implicit_resolvers = {
    first: [(tag, pattern) for tag, pattern in resolvers if tag != _TIMESTAMP]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}


def compose(text: str, what: str) -> list[yaml.Node]:
    """The documents' node graphs (an alias is the node it names), within the bounds."""
    if len(text) > MAX_CHARACTERS:
        raise UnreadableYaml(f"{what} is {len(text):,} characters, more than the {MAX_CHARACTERS:,} read at most")
    _check_nesting(text, what)
    try:
        documents = [node for node in yaml.compose_all(text, Loader=TextDatesLoader) if node is not None]
    except yaml.YAMLError as error:
        raise UnreadableYaml(f"{what} is not valid YAML ({_place(error)})") from None
    except RecursionError:  # not reached within MAX_NESTING; kept so that no traceback can escape
        raise UnreadableYaml(f"{what} is nested too deeply") from None
    for node in documents:
        _check_size(node, what)
    return documents


def load(text: str, what: str) -> list[Any]:
    """The documents' values (``yaml.safe_load_all``'s, dates as text), within the bounds."""
    loader = TextDatesLoader("")
    try:
        return [loader.construct_document(node) for node in compose(text, what)]
    except (yaml.YAMLError, ValueError, TypeError, OverflowError) as error:  # ``!!int x``, ``!!timestamp 2024-13-01``
        if isinstance(error, UnreadableYaml):
            raise
        raise UnreadableYaml(f"{what} has a value that cannot be read ({_place(error)})") from None
    finally:
        loader.dispose()


def load_one(text: str, what: str) -> Any:
    """The single document's value (None for empty text); more than one document is refused."""
    documents = load(text, what)
    if len(documents) > 1:
        raise UnreadableYaml(f"{what} holds {len(documents)} YAML documents; one is expected")
    return documents[0] if documents else None


def dump(data: Any, line_break: str = "\n") -> str:
    """``data`` as mergekit writes a card's front matter (``yaml.dump``'s layout; text that looks like a date
    quoted), read back equal by ``load``."""
    return yaml.dump(data, Dumper=yaml.SafeDumper, line_break=line_break)


def _check_nesting(text: str, what: str) -> None:
    """From the parser's events, before the (recursive) composer runs."""
    depth = 0
    try:
        for event in yaml.parse(text, Loader=TextDatesLoader):
            if isinstance(event, yaml.CollectionStartEvent):
                depth += 1
                if depth > MAX_NESTING:
                    mark = event.start_mark
                    raise UnreadableYaml(
                        f"{what} nests lists or mappings more than {MAX_NESTING} levels deep at line {mark.line + 1}, "
                        f"column {mark.column + 1}"
                    )
            elif isinstance(event, yaml.CollectionEndEvent):
                depth -= 1
    except yaml.YAMLError as error:
        raise UnreadableYaml(f"{what} is not valid YAML ({_place(error)})") from None


def _check_size(root: yaml.Node, what: str) -> None:
    """Nodes counted as constructed (each alias as the whole node it names), iteratively; a cycle is refused."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        if id(node) in sizes:
            continue
        children = list(_children(node))
        if children_done:
            open_nodes.discard(id(node))
            sizes[id(node)] = min(1 + sum(sizes[id(child)] for child in children), MAX_NODES + 1)
            if sizes[id(node)] > MAX_NODES:
                raise UnreadableYaml(
                    f"{what} expands to more than {MAX_NODES:,} values through its aliases (*name) near line "
                    f"{node.start_mark.line + 1}"
                )
            continue
        if id(node) in open_nodes:
            raise UnreadableYaml(f"{what} has an alias inside the node it names, near line {node.start_mark.line + 1}")
        open_nodes.add(id(node))
        stack.append((node, True))
        stack.extend((child, False) for child in children if id(child) not in sizes)
    return None


def _children(node: yaml.Node) -> Iterator[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        yield from node.value
    elif isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            yield key
            yield value


def _place(error: BaseException) -> str:
    """The parser's problem and line, on one line."""
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None) or one_line(error)
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else problem
