"""Conversations to ids through a Hugging Face tokenizer's own chat template, with the response spans found.

A model fine-tuned from Hugging Face weights should be taught in the format its tokenizer's
chat template writes (``apply_chat_template``, which ``transformers`` implements: it is an
optional dependency, imported only when a tokenizer directory is given).

The template renders a whole conversation; which of its tokens are the assistant's is found
by rendering, for each assistant turn, the conversation before it with the generation prompt
(the assistant's header) and the conversation through it: the turn's tokens are those between
the two, end-of-turn token included. That holds only if each rendering is a prefix of the
next, which is checked: a template that rewrites earlier turns (some drop past reasoning) is
refused, naming the turn, rather than trained on the wrong tokens.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Optional

from lightning_megatron.data.conversations import Encoded, Message


class HFChatTokenizer:
    """A Hugging Face tokenizer directory (``AutoTokenizer.from_pretrained``) behind the package's ``Tokenizer``
    protocol, plus its chat template.

    ``vocab_size`` counts the added tokens too (``len(tokenizer)``); ``encode`` adds no special tokens (the
    prompt style or the template places them); ``bos_id`` is the beginning-of-sequence id the tokenizer puts
    before every text it encodes (Llama's), ``None`` when it puts none (GPT-2's and Qwen's).
    """

    def __init__(self, directory: str | os.PathLike) -> None:
        try:
            import transformers
        except ImportError as error:
            raise ImportError(f"tokenizer={os.fspath(directory)!r} is a Hugging Face tokenizer directory, which needs "
                              f"the optional `transformers` package: pip install transformers (or use "
                              f"tokenizer='byte').") from error
        self.path = Path(directory)
        self.hf = transformers.AutoTokenizer.from_pretrained(str(self.path))
        if self.hf.eos_token_id is None:
            raise ValueError(f"The tokenizer in {self.path} has no end-of-sequence token; set one (eos_token in its "
                             f"tokenizer_config.json) so that responses end with it and generation stops.")
        self.eos_id: int = self.hf.eos_token_id
        first = self.hf.encode("a", add_special_tokens=True)[0]  # what the tokenizer itself puts before a text
        self.bos_id: Optional[int] = first if first == self.hf.bos_token_id else None
        self.vocab_size: int = len(self.hf)
        self.chat_template: Optional[str] = self.hf.chat_template

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False)

    def decode(self, ids: Iterable[int]) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=True)

    def vocabulary(self) -> str:
        """The tokenizer's whole definition as text (a fast tokenizer's ``tokenizer.json``, else its vocabulary), for
        cache keys."""
        if self.hf.is_fast:
            return self.hf.backend_tokenizer.to_str()
        return json.dumps(sorted(self.hf.get_vocab().items()))


class ChatTemplateFormat:
    """Conversations to ids with the tokenizer's chat template, the assistant turns marked as trained."""

    def __init__(self, tokenizer: HFChatTokenizer) -> None:
        if not tokenizer.chat_template:
            raise ValueError(
                f"The tokenizer in {tokenizer.path} has no chat template, so conversations cannot be formatted with "
                f"it; pass prompt_style='plain' (or a dict of 'system', 'user' and 'assistant' templates) to write "
                f"them as plain text, or use a tokenizer that has one (an instruct model's)."
            )
        self.tokenizer = tokenizer

    def _render(self, messages: Sequence[Message], generation_prompt: bool) -> list[int]:
        chat = [{"role": m.role, "content": m.content} for m in messages]
        return list(self.tokenizer.hf.apply_chat_template(chat, tokenize=True, add_generation_prompt=generation_prompt,
                                                          return_dict=False))

    def encode(self, messages: Sequence[Message]) -> Encoded:
        ids = self._render(messages, False)
        trained = [False] * len(ids)
        for turn, message in enumerate(messages):
            if message.role != "assistant":
                continue
            before, through = self._render(messages[:turn], True), self._render(messages[: turn + 1], False)
            if through[: len(before)] != before or ids[: len(through)] != through:
                raise ValueError(
                    f"The chat template of {self.tokenizer.path} does not render the conversation before assistant "
                    f"turn {turn} as a prefix of the conversation through it (or of the whole), so the response's "
                    f"tokens cannot be told apart; use prompt_style='plain' or a template that only appends turns."
                )
            if len(through) == len(before):
                raise ValueError(f"The chat template of {self.tokenizer.path} renders assistant turn {turn} as no "
                                 f"tokens; its response would not be trained on.")
            trained[len(before) : len(through)] = [True] * (len(through) - len(before))
        return Encoded(ids, trained)

    def prompt(self, messages: Sequence[Message]) -> list[int]:
        """The ids of ``messages`` (ending with a user turn) and the generation prompt (the assistant's header)."""
        return self._render(messages, True)

    def identity(self) -> dict:
        """What the ids depend on besides the tokenizer's vocabulary (a cache key's part)."""
        return {"chat_template": self.tokenizer.chat_template}
