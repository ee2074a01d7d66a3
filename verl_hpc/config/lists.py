"""Long lists of plain values kept out of OmegaConf's merge, which costs time per item.

OmegaConf wraps every list item in a node of its own and validates it as it merges and again as it
converts back: about 150 us an item, so a config of 600,000 `rollout.stop` strings (6 MB) spent 90 s
in the merge, after a 3 s parse. The merge is there for the interpolations (`${trainer.output_dir}`)
and the typed defaults; a list whose items are plain values (no mapping, no list, no '${') needs
neither: its items were checked against the schema already (structure.check_value), a list replaces
the one below it whole (loader.deep_merge, as OmegaConf does), and nothing else refers to it.

    lifted = lift(user, refs)           # user's plain lists -> placeholders ([]), by path
    plain = OmegaConf.to_container(OmegaConf.merge(defaults, recipe, user), resolve=True)
    put_back(plain, lifted)             # and put_back(user, lifted) for the error messages

A list stays in the merge when an interpolation anywhere in the config may point at it: one that
names its key, or one that ends at a section holding it (`${rollout}`). The result is the same
either way; lifting only saves the time.
"""
from __future__ import annotations

import re
from typing import Any, Dict, Iterable, Iterator, Set, Tuple

_INTERPOLATION = re.compile(r"\$\{([^}]*)\}")
_WORD = re.compile(r"[A-Za-z_][\w-]*")
_PLAIN = (str, int, float, bool, type(None))


def interpolations(value: Any) -> Iterator[str]:
    """Every string holding '${' in a nested value (escaped ones too: they are not plain text to
    OmegaConf, which turns '\\${' into '${')."""
    if isinstance(value, str):
        if "${" in value:
            yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from interpolations(v)
    elif isinstance(value, (list, tuple)):
        if all(type(v) is str and "${" not in v for v in value):  # the common long list: one pass in C
            return
        for v in value:
            yield from interpolations(v)


def referred(texts: Iterable[str]) -> Tuple[Set[str], Set[str]]:
    """(every key named inside an interpolation, the last key of each): what a list's path must
    avoid to be lifted."""
    named, last = set(), set()
    for text in texts:
        for inner in _INTERPOLATION.findall(text):
            words = _WORD.findall(inner)
            named.update(words)
            if words:
                last.add(words[-1])
    return named, last


def lift(data: Dict[str, Any], refs: Tuple[Set[str], Set[str]], path: tuple = ()) -> Dict[tuple, list]:
    """Replace in `data` (in place) each list of plain values no interpolation refers to with [];
    returns them by path."""
    named, last = refs
    out: Dict[tuple, list] = {}
    for key, value in data.items():
        here = path + (key,)
        if isinstance(value, dict):
            if key not in last:  # `${rollout}` takes the whole section: leave it to OmegaConf
                out.update(lift(value, refs, here))
        elif isinstance(value, list) and value and key not in named and _plain(value):
            out[here] = value
            data[key] = []
    return out


def _plain(items: list) -> bool:
    if all(type(v) is str for v in items):  # the common long list (stop strings, files): C loops
        return not any("${" in v for v in items)
    return all(isinstance(v, _PLAIN) and not (isinstance(v, str) and "${" in v) for v in items)


def put_back(data: Dict[str, Any], lifted: Dict[tuple, list]) -> None:
    """Each lifted list back at its path in `data` (the merged plain config, or the user's layer)."""
    for path, items in lifted.items():
        node = data
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = items
