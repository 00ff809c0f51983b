"""Supervised fine-tuning rows read from ``.jsonl`` or ``.parquet`` files into checked conversations.

A row is either a prompt and its response, ``{"prompt": ..., "response": ...}`` (with an
optional ``"system"``), or a chat, ``{"messages": [{"role": ..., "content": ...}, ...]}``:
an optional first ``system`` message, then ``user`` and ``assistant`` turns in turn, the last
an ``assistant`` one (a conversation that ends on a question has nothing to learn). Every
assistant turn is trained on, so a multi-turn chat teaches all of its answers.

A row that is not one of these, or whose response is missing or empty, is refused with a
``ValueError`` naming the file and the line (``FILE:LINE``) or row (``FILE, row N``): nothing
is skipped silently, since a skipped row would silently change what the model learns.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from lightning_megatron.data.readers import PARQUET_SUFFIX, _import_pyarrow

ROLES = ("system", "user", "assistant")
_FORMS = ('{"prompt": "...", "response": "..."} (optionally "system") or '
          '{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}, ...]}')


class Message(NamedTuple):
    role: str
    content: str


Conversation = tuple[Message, ...]


class Encoded(NamedTuple):
    """A tokenised conversation: its ``ids`` and, per id, whether it is a response token (a training target); lists,
    or numpy arrays when read from the cache."""

    ids: Sequence[int]
    trained: Sequence[bool]


def conversation(row: Any) -> Conversation:
    """The checked conversation of one row (a dict); ``ValueError`` with the reason otherwise (no place: the
    reader adds it)."""
    if not isinstance(row, dict):
        raise ValueError(f"expected an object, got {type(row).__name__}")
    if row.get("messages") is not None:  # a parquet file's absent values are nulls
        messages = row["messages"]
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError(f"'messages' must be a non-empty list of {{'role', 'content'}} objects, got {messages!r}")
        return check_turns([message(m, i) for i, m in enumerate(messages)])
    if "prompt" in row or "response" in row:
        turns = [Message("system", _text(row, "system"))] if row.get("system") is not None else []
        turns += [Message("user", _text(row, "prompt")), Message("assistant", _text(row, "response"))]
        return check_turns(turns)
    raise ValueError(f"no 'messages' and no 'prompt'/'response' (keys: {', '.join(map(repr, row)) or 'none'})")


def _text(row: dict, key: str) -> str:
    value = row.get(key)
    if value is None:
        raise ValueError(f"{key!r} is missing")
    if not isinstance(value, str):
        raise ValueError(f"{key!r} is a {type(value).__name__}, not a string")
    return value


def message(item: Any, index: int) -> Message:
    """Message ``index`` of a conversation from its ``{"role", "content"}`` object, checked."""
    if not isinstance(item, dict) or not {"role", "content"} <= set(item):
        raise ValueError(f"message {index} must be an object with 'role' and 'content', got {item!r}")
    role, content = item["role"], item["content"]
    if role not in ROLES:
        raise ValueError(f"message {index} has role {role!r}; the roles are {', '.join(ROLES)}")
    if not isinstance(content, str):
        raise ValueError(f"message {index} ({role}) has content of type {type(content).__name__}, not a string")
    return Message(role, content)


def check_turns(turns: Sequence[Message]) -> Conversation:
    """``turns`` if they are an optional system message, then user and assistant turns alternating, ending with a
    non-empty assistant turn; ``ValueError`` naming the first turn that is not."""
    start = 1 if turns and turns[0].role == "system" else 0
    if len(turns) == start:
        raise ValueError("the conversation has no user and assistant turns")
    for i, turn in enumerate(turns[start:], start=start):
        expected = "user" if (i - start) % 2 == 0 else "assistant"
        if turn.role != expected:
            raise ValueError(f"message {i} is a {turn.role!r} turn where a {expected!r} turn belongs (an optional "
                             f"system message first, then user and assistant turns in turn)")
        if expected == "assistant" and not turn.content.strip():
            raise ValueError(f"the response (message {i}) is empty; every assistant turn needs text to learn")
    if turns[-1].role != "assistant":
        raise ValueError(f"the last message ({len(turns) - 1}) is a {turns[-1].role!r} turn; a conversation must end "
                         f"with the assistant's response")
    return tuple(turns)


def _rows(path: Path) -> Iterator[tuple[str, Any]]:
    """``(place, row)`` of every row of ``path`` (``FILE:LINE`` or ``FILE, row N``); blank lines are no rows."""
    if path.suffix == PARQUET_SUFFIX:
        pa = _import_pyarrow()
        try:
            parquet = pa.parquet.ParquetFile(path)
        except pa.ArrowException as error:
            raise ValueError(f"{path} is not a readable parquet file: {error}") from None
        number = 0
        for batch in parquet.iter_batches(batch_size=1024):
            for row in batch.to_pylist():
                number += 1
                yield f"{path}, row {number}", row
        return
    with open(path, "rb") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                yield where, json.loads(line)
            except (UnicodeDecodeError, json.JSONDecodeError) as error:
                raise ValueError(f"{where}: invalid JSON ({error}); each line must be {_FORMS}.") from None


def check_data_file(path: str | os.PathLike) -> Path:
    """``path`` if it is an existing ``.jsonl`` or ``.parquet`` file; the error says what it should be otherwise."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"SFT data {path} does not exist (give a .jsonl or .parquet file).")
    if path.suffix not in (".jsonl", PARQUET_SUFFIX):
        raise ValueError(f"SFT data {path} must be a .jsonl file (one JSON object per line) or a .parquet file "
                         f"(one row per conversation), with rows {_FORMS}.")
    return path


def read_conversations(path: str | os.PathLike) -> list[Conversation]:
    """Every conversation of a ``.jsonl`` or ``.parquet`` file, in order."""
    path = check_data_file(path)
    conversations = []
    for where, row in _rows(path):
        try:
            conversations.append(conversation(row))
        except ValueError as error:
            raise ValueError(f"{where}: {error}; each row must be {_FORMS}.") from None
    if not conversations:
        raise ValueError(f"SFT data {path} holds no rows; each row must be {_FORMS}.")
    return conversations
