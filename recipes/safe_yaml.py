"""YAML read with limits: what a recipe file or a ``--set`` value may hold, checked before anything is built.

Method note: docs/methods/recipes.md.
"""

from __future__ import annotations

from typing import Any

import yaml

from slimkit.primitives.errors import SlimkitError

MAX_NODES = 100_000
"""The most values (scalars, lists, mappings) a document may hold once its aliases are expanded."""
MAX_DEPTH = 32
"""How deeply lists and mappings may nest (a recipe nests 5 levels)."""

_CORE = "tag:yaml.org,2002:"
_MERGE = _CORE + "merge"
SCALAR_TAGS = {_CORE + name for name in ("str", "int", "float", "bool", "null")} | {_MERGE}
_STR = _CORE + "str"


def _where(origin: str, node: yaml.Node) -> str:
    mark = node.start_mark
    return f"{origin}: line {mark.line + 1}, column {mark.column + 1}"


def _short_tag(tag: str) -> str:
    return "!!" + tag.removeprefix(_CORE) if tag.startswith(_CORE) else tag


def _check_mapping_keys(node: yaml.MappingNode, origin: str) -> None:
    seen: dict[str, yaml.Node] = {}
    for key, _value in node.value:
        if key.tag == _MERGE:
            continue
        if not isinstance(key, yaml.ScalarNode) or key.tag != _STR:
            shown = key.value if isinstance(key, yaml.ScalarNode) else type(key).__name__.removesuffix("Node").lower()
            raise SlimkitError(
                f"{_where(origin, key)}: key {shown or 'null'!r} is not a string ({_short_tag(key.tag)}); "
                "every key of a recipe is a name: quote it"
            )
        if key.value in seen:
            first = seen[key.value].start_mark.line + 1
            raise SlimkitError(
                f"{_where(origin, key)}: key '{key.value}' appears twice in one mapping (first on line {first}); "
                "keep one"
            )
        seen[key.value] = key


def check_nodes(root: yaml.Node, origin: str) -> int:
    """Check the composed document ``root``; returns its node count with aliases expanded."""
    sizes: dict[int, int] = {}
    depths: dict[int, int] = {}
    open_nodes: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        if done:
            children = _children(node)
            sizes[key] = 1 + sum(sizes[id(child)] for child in children)
            depths[key] = 1 + max((depths[id(child)] for child in children), default=0) if children else 0
            open_nodes.discard(key)
            if sizes[key] > MAX_NODES:
                raise SlimkitError(
                    f"{_where(origin, node)}: expands to more than {MAX_NODES:,} values (aliases repeat what they "
                    "name); write the values out"
                )
            if depths[key] > MAX_DEPTH:
                raise SlimkitError(f"{_where(origin, node)}: nested more than {MAX_DEPTH} levels deep")
            continue
        if key in sizes:
            continue
        if key in open_nodes:
            raise SlimkitError(f"{_where(origin, node)}: an alias refers to a value that contains it")
        if isinstance(node, yaml.ScalarNode):
            if node.tag not in SCALAR_TAGS:
                raise SlimkitError(
                    f"{_where(origin, node)}: {_short_tag(node.tag)} value {node.value[:40]!r}: a recipe holds "
                    "strings, numbers, booleans, null, lists and mappings only (quote it to make it a string)"
                )
            sizes[key], depths[key] = 1, 0
            continue
        expected = _CORE + ("map" if isinstance(node, yaml.MappingNode) else "seq")
        if node.tag != expected:
            raise SlimkitError(
                f"{_where(origin, node)}: {_short_tag(node.tag)}: a recipe holds strings, numbers, booleans, null, "
                "lists and mappings only"
            )
        if isinstance(node, yaml.MappingNode):
            _check_mapping_keys(node, origin)
        open_nodes.add(key)
        stack.append((node, True))
        stack.extend((child, False) for child in _children(node))
    return sizes[id(root)]


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def _check_nesting(text: str, origin: str) -> None:
    """Refuse deep nesting from the event stream, before the (recursive) composer sees it."""
    depth = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            if depth > MAX_DEPTH:
                mark = event.start_mark
                where = f"line {mark.line + 1}, column {mark.column + 1}"
                raise SlimkitError(f"{origin}: {where}: nested more than {MAX_DEPTH} levels deep")
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1


def load_yaml(text: str, origin: str) -> Any:
    """The value of the YAML document ``text`` (None when empty), checked as the module says; ``origin`` names it
    in errors. A syntax error is one line with its position."""
    loader = yaml.SafeLoader(text)
    try:
        _check_nesting(text, origin)
        root = loader.get_single_node()
        if root is None:
            return None
        check_nodes(root, origin)
        return loader.construct_document(root)
    except RecursionError:
        raise SlimkitError(f"{origin}: nested more than {MAX_DEPTH} levels deep") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise SlimkitError(f"{origin}:{where}: YAML syntax error: {problem}") from None
    finally:
        loader.dispose()


__all__ = ["MAX_DEPTH", "MAX_NODES", "SCALAR_TAGS", "check_nodes", "load_yaml"]
