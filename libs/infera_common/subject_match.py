"""NATS subject matching, without I/O: validation, one-pattern matching, and an index of many patterns.

Subjects are ``.``-separated, non-empty tokens without whitespace. In a subscription pattern a
token ``*`` matches exactly one token and a final token ``>`` one or more; ``>`` before the last
token (``a.>.b``) is refused, and inside a token (``foo*``) both are plain characters. A published
subject has no wildcard token.

``SubjectIndex`` answers "who is subscribed to this subject" the way a nats-server's sublist does.
The hot paths are dict lookups: patterns without wildcards (the route subject, a load report) by
subject, patterns whose only wildcard is a final ``*`` (an inbox ``_INBOX.<id>.*``, the load
reports ``infera.load.*``) by the subject less its last token. Other patterns live in a per-token
trie, walked only while it holds any.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Generic, TypeVar

T = TypeVar("T", bound=Hashable)

def subject_error(subject: str, *, pattern: bool) -> str | None:
    """Why ``subject`` is not a valid subscription pattern (``pattern``) or publish subject; None if it is."""
    if not subject:
        return "empty subject"
    if " " in subject or "\t" in subject or "\r" in subject or "\n" in subject:
        return f"whitespace in subject {subject!r}"
    if subject[0] == "." or subject[-1] == "." or ".." in subject:
        return f"empty token in subject {subject!r}"
    if "*" not in subject and ">" not in subject:  # the common case: no token can be a wildcard
        return None
    tokens = subject.split(".")
    last = len(tokens) - 1
    for i, token in enumerate(tokens):
        if not pattern:
            if token in ("*", ">"):
                return f"wildcard {token!r} in published subject {subject!r}"
        elif token == ">" and i != last:
            return f"'>' must be the last token of {subject!r}"
    return None


def has_wildcard(pattern: str) -> bool:
    """True when a valid pattern contains a ``*`` or ``>`` token."""
    return any(token in ("*", ">") for token in pattern.split("."))


def subject_matches(pattern: str, subject: str) -> bool:
    """Whether the valid pattern ``pattern`` matches the valid published subject ``subject``."""
    p, s = pattern.split("."), subject.split(".")
    for i, token in enumerate(p):
        if token == ">":
            return len(s) > i
        if i >= len(s) or (token != "*" and token != s[i]):
            return False
    return len(p) == len(s)


def _kind(pattern: str) -> tuple[str, str]:
    """Where a pattern is filed: ``exact`` (no wildcard token) under itself; ``star_last`` (its only
    wildcard is a final ``*``: 'a.b.*') under its head 'a.b'; else ``trie``."""
    if "*" not in pattern and ">" not in pattern:
        return "exact", pattern
    head, _, last = pattern.rpartition(".")
    if last == "*" and head and not has_wildcard(head):
        return "star_last", head
    if not has_wildcard(pattern):  # '*' or '>' inside a token: a literal character
        return "exact", pattern
    return "trie", ""


class _Node:
    __slots__ = ("children", "star", "items", "tail")

    def __init__(self) -> None:
        self.children: dict[str, _Node] = {}
        self.star: _Node | None = None  # the ``*`` child
        self.items: list = []  # patterns ending at this node
        self.tail: list = []  # patterns ending with ``>`` right after this node

    def empty(self) -> bool:
        return not (self.children or self.star or self.items or self.tail)


class SubjectIndex(Generic[T]):
    """Items (subscriptions) filed under subject patterns; ``match`` lists those a subject reaches.

    An item is added under one pattern at a time; ``match`` returns each matching item once, exact
    patterns first, in no further guaranteed order. Callers validate patterns first (``subject_error``).
    """

    def __init__(self) -> None:
        self._exact: dict[str, list[T]] = {}
        self._star_last: dict[str, list[T]] = {}  # 'a.b.*' filed under 'a.b'
        self._root = _Node()
        self._wildcards = 0  # patterns in the trie
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def add(self, pattern: str, item: T) -> None:
        self._size += 1
        kind, key = _kind(pattern)
        if kind != "trie":
            (self._exact if kind == "exact" else self._star_last).setdefault(key, []).append(item)
            return
        self._wildcards += 1
        node = self._root
        tokens = pattern.split(".")
        for token in tokens[:-1]:
            node = self._child(node, token)
        last = tokens[-1]
        if last == ">":
            node.tail.append(item)
        else:
            self._child(node, last).items.append(item)

    @staticmethod
    def _child(node: _Node, token: str) -> _Node:
        if token == "*":
            if node.star is None:
                node.star = _Node()
            return node.star
        child = node.children.get(token)
        if child is None:
            child = node.children[token] = _Node()
        return child

    def remove(self, pattern: str, item: T) -> bool:
        """Take ``item`` out from under ``pattern``; False when it was not there."""
        kind, key = _kind(pattern)
        if kind != "trie":
            table = self._exact if kind == "exact" else self._star_last
            items = table.get(key)
            if not items or item not in items:
                return False
            items.remove(item)
            if not items:
                del table[key]
            self._size -= 1
            return True
        tokens = pattern.split(".")
        path: list[tuple[_Node, str]] = []  # (parent, token) down to the node holding the item
        node = self._root
        for token in tokens[:-1]:
            nxt = node.star if token == "*" else node.children.get(token)
            if nxt is None:
                return False
            path.append((node, token))
            node = nxt
        last = tokens[-1]
        if last == ">":
            bucket = node.tail
        else:
            leaf = node.star if last == "*" else node.children.get(last)
            if leaf is None:
                return False
            path.append((node, last))
            node = leaf
            bucket = node.items
        if item not in bucket:
            return False
        bucket.remove(item)
        self._size -= 1
        self._wildcards -= 1
        for parent, token in reversed(path):  # prune the branch it leaves empty
            child = parent.star if token == "*" else parent.children[token]
            if not child.empty():
                break
            if token == "*":
                parent.star = None
            else:
                del parent.children[token]
        return True

    def match(self, subject: str) -> list[T]:
        """Every item whose pattern matches the published subject ``subject``."""
        exact = self._exact.get(subject)
        out: list[T] = list(exact) if exact else []
        if self._star_last:
            dot = subject.rfind(".")
            if dot > 0:
                star = self._star_last.get(subject[:dot])
                if star:
                    out.extend(star)
        if not self._wildcards:
            return out
        tokens = subject.split(".")
        n = len(tokens)
        stack = [(self._root, 0)]
        while stack:
            node, i = stack.pop()
            if i == n:
                out.extend(node.items)
                continue
            if node.tail:  # '>' takes the one or more tokens left
                out.extend(node.tail)
            child = node.children.get(tokens[i])
            if child is not None:
                stack.append((child, i + 1))
            if node.star is not None:
                stack.append((node.star, i + 1))
        return out
