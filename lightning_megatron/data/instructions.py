"""The built-in instruction set: short word and number tasks, made in memory from a fixed seed (no download).

It is what :class:`~lightning_megatron.data.SFTDataModule` trains on when no data is given:
small enough that a tiny byte-level model learns its format in a minute or two on a CPU,
with one response format that generation can be checked against afterwards
(:data:`ANSWER_PATTERN`): ``Answer: `` and the result, then the end-of-sequence id. The
tasks: uppercase a word, reverse it, sort its letters, add two numbers below 50. Words are
random lowercase letters (3 to 6), so the set is the same on every machine and Python.

Example::

    >>> instruction_set(2)[0]
    (Message(role='user', content='Sort the letters of tug.'), Message(role='assistant', content='Answer: gtu'))
"""

from __future__ import annotations

import random
import re
import string

from lightning_megatron.data.conversations import Conversation, Message

#: What every response of the set looks like (check generations with ``ANSWER_PATTERN.fullmatch(text)``).
ANSWER_PATTERN = re.compile(r"Answer: [A-Za-z0-9]+")
#: Conversations in the set: enough for a held-out split of a hundred and a few minutes of CPU training.
DEFAULT_SIZE = 2000
_SEED = 30
#: The set in a cache key: a change to the tasks must change it, so that cached tokens of the old set are not used.
BUILTIN_SOURCE = {"builtin": "instructions", "size": DEFAULT_SIZE, "version": 1}


def _word(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 6)))


def _task(rng: random.Random) -> tuple[str, str]:
    kind = rng.randrange(4)
    if kind == 3:
        a, b = rng.randrange(50), rng.randrange(50)
        return f"Add {a} and {b}.", str(a + b)
    word = _word(rng)
    if kind == 0:
        return f"Uppercase {word}.", word.upper()
    if kind == 1:
        return f"Reverse {word}.", word[::-1]
    return f"Sort the letters of {word}.", "".join(sorted(word))


def instruction_set(size: int = DEFAULT_SIZE) -> list[Conversation]:
    """``size`` single-turn conversations with distinct prompts (a held-out prompt is then never a training one),
    the same for the same ``size``; the first ones do not depend on it."""
    rng = random.Random(_SEED)
    conversations, seen = [], set()
    while len(conversations) < size:
        prompt, answer = _task(rng)
        if prompt not in seen:
            seen.add(prompt)
            conversations.append((Message("user", prompt), Message("assistant", f"Answer: {answer}")))
    return conversations
