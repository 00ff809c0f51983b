"""Sentences for ``lightning-megatron preprocess --split-sentences``: a rule-based splitter needing no downloads
(each sentence is then one sequence of its document in the indexed dataset).

Megatron-LM splits BERT data into sentences with NLTK's punkt model, which must be
downloaded; these few rules need nothing and are predictable, which matters more for
pre-training data than the last percent of accuracy. A sentence ends

* at ``.``, ``!`` or ``?`` (after any closing quotes or brackets) followed by a line break,
  or by spaces and then an uppercase letter, a digit or an opening quote or bracket;
* at a blank line (a paragraph, or in code a group of lines: code seldom has the endings
  above outside its comments, so its sentences are its blank-line separated line groups).

A period does not end a sentence after a common abbreviation (``e.g.``, ``Dr.``, ``vs.``,
...) or a run of single letters (initials ``J.``, ``U.S.``, ``a.m.``); it never does inside
a number (``3.14``), since no whitespace follows it there. The price is a missed end after a
single letter (``plan B. Then``).

The sentences are pieces of the text: joined they give it back exactly. The whitespace
between two sentences goes up to its last line break to the first (which then ends with
its line break), the rest to the second, so a sentence starts at its first word or, in
code, at its indentation; a byte-level tokenizer then sees what it sees in running text.

Example::

    >>> split_sentences("Pi is 3.14, e.g. in math. It is irrational!\\nYes.")
    ['Pi is 3.14, e.g. in math.', ' It is irrational!\\n', 'Yes.']
"""

from __future__ import annotations

import re

#: Words that a period follows without ending the sentence (lowercase, without the period). Runs of
#: single letters (``e.g``, ``U.S``, initials) need no entry; ``etc`` has none: it ends sentences as often as not.
ABBREVIATIONS = frozenset("al approx cf dept dr eq fig figs inc jr ltd mr mrs ms prof pp sr vol vs".split())
_CLOSERS = "\"'”’)]}"
_OPENERS = "\"'“‘([{"
# An ending (terminator, closers) and the whitespace after it, or whitespace holding a blank line.
_CANDIDATE = re.compile(r"([.!?][" + re.escape(_CLOSERS) + r"]*)(\s+)|\s*\n[^\S\n]*\n\s*")
_WORD_BEFORE_PERIOD = re.compile(r"(?<!\w)[A-Za-z][A-Za-z.]*$")  # a word, not the letters after a digit ("1st")
_SINGLE_LETTERS = re.compile(r"(?:[A-Za-z]\.)*[A-Za-z]")


def _is_abbreviation(text_before_period: str) -> bool:
    match = _WORD_BEFORE_PERIOD.search(text_before_period[-32:])
    word = match.group() if match else ""
    return word.lower() in ABBREVIATIONS or _SINGLE_LETTERS.fullmatch(word) is not None


def _boundary(text: str, match: re.Match) -> int | None:
    """Where the sentence before ``match`` ends and the next starts, or ``None`` when it does not end there."""
    ending, gap = match.group(1), match.group(2)
    start = match.start(2) if ending else match.start()
    if match.end() == len(text) or match.start() == 0:
        return None  # whitespace at the very start or end of the text belongs to its only neighbour
    if gap is None or gap.count("\n") >= 2:  # a blank line
        whitespace = match.group() if gap is None else gap
        return start + whitespace.rindex("\n") + 1
    if ending[0] == "." and _is_abbreviation(text[: match.start()]):
        return None
    if "\n" in gap:
        return start + gap.index("\n") + 1
    following = text[match.end()]
    return start if following.isupper() or following.isdigit() or following in _OPENERS else None


def split_sentences(text: str) -> list[str]:
    """The sentences of ``text`` by the rules of the module docstring; ``"".join`` of them is ``text``.

    A text without a sentence end is one sentence; an empty text has none.
    """
    pieces, start = [], 0
    for match in _CANDIDATE.finditer(text):
        boundary = _boundary(text, match)
        if boundary is not None and boundary > start:
            pieces.append(text[start:boundary])
            start = boundary
    if start < len(text):
        pieces.append(text[start:])
    return pieces


