"""NATS subject matching for the in-process bus (``subject_match.py``): validation, one pattern, the index."""

from __future__ import annotations

import itertools
import random

import pytest

from infera_common.subject_match import SubjectIndex, subject_error, subject_matches


@pytest.mark.parametrize("pattern, subject, expected", [
    ("a.b", "a.b", True),
    ("a.b", "a.c", False),
    ("a.*", "a.b", True),
    ("a.*", "a.b.c", False),
    ("a.*", "a", False),
    ("*.b", "a.b", True),
    ("a.>", "a.b", True),
    ("a.>", "a.b.c.d", True),
    ("a.>", "a", False),
    (">", "a", True),
    (">", "a.b.c", True),
    ("*", "a.b", False),
    ("a.*.c", "a.x.c", True),
    ("a.*.c", "a.x.d", False),
    ("_INBOX.fe-1.*", "_INBOX.fe-1.42", True),
    ("_INBOX.fe-1.*", "_INBOX.fe-2.42", False),
    ("a.b*", "a.bc", False),  # '*' inside a token is a literal character
    ("a.b*", "a.b*", True),
])
def test_subject_matches(pattern, subject, expected):
    assert subject_matches(pattern, subject) is expected


@pytest.mark.parametrize("subject, pattern_ok, publish_ok", [
    ("a.b.c", True, True),
    ("a.*", True, False),
    ("a.>", True, False),
    (">", True, False),
    ("a.>.b", False, False),
    ("", False, False),
    ("a..b", False, False),
    (".a", False, False),
    ("a.", False, False),
    ("a b", False, False),
    ("a\r\nPUB x", False, False),
])
def test_subject_validation(subject, pattern_ok, publish_ok):
    assert (subject_error(subject, pattern=True) is None) is pattern_ok
    assert (subject_error(subject, pattern=False) is None) is publish_ok


def test_the_index_finds_exactly_what_one_by_one_matching_finds_as_patterns_come_and_go():
    rng = random.Random(7)
    words = ["a", "b", "c"]

    def subject(n: int) -> str:
        return ".".join(rng.choice(words) for _ in range(n))

    def pattern() -> str:
        tokens = [rng.choice(words + ["*"]) for _ in range(rng.randint(1, 4))]
        if rng.random() < 0.3:
            tokens[-1] = ">"
        return ".".join(tokens)

    index: SubjectIndex[int] = SubjectIndex()
    live: dict[int, str] = {}
    ids = itertools.count()
    for step in range(3000):
        if live and rng.random() < 0.4:
            item = rng.choice(sorted(live))
            assert index.remove(live.pop(item), item)
        else:
            item = next(ids)
            live[item] = pattern()
            index.add(live[item], item)
        if step % 10 == 0:
            s = subject(rng.randint(1, 5))
            assert sorted(index.match(s)) == sorted(i for i, p in live.items() if subject_matches(p, s))
    for item, p in list(live.items()):
        assert index.remove(p, item)
    assert len(index) == 0 and index.match("a.b") == []
    assert not index._exact and not index._star_last and index._root.empty()  # pruned: nothing leaks
    assert not index.remove("a.*", 1)
