"""Conversations to ids through a Hugging Face tokenizer's own chat template, with the response tokens found.

A model fine-tuned from Hugging Face weights should be taught in the format its tokenizer's
chat template writes (``apply_chat_template``, which ``transformers`` implements: it is an
optional dependency, imported only when a tokenizer directory is given). Which tokens are
the assistant's, and so trained, is found by one of two rules, chosen by the template:

* **Generation markers.** A template that wraps the assistant's text in ``{% generation %}``
  ... ``{% endgeneration %}`` blocks (transformers' marker) says itself what a response is:
  the trained tokens are exactly those ``apply_chat_template(..., return_assistant_tokens_mask=True)``
  marks (``assistant_masks``: every token that overlaps a block's text), as transformers and
  TRL train them. The marks come from token offsets, which only a fast tokenizer has: a
  slow one is refused when it would train (its prompts need no marks), naming the fix. A
  template whose blocks mark none of a conversation's tokens, or leave out the
  end-of-sequence token (the model would not learn to stop), is refused, naming the fix.
* **Prefixes** (a template without markers). For each assistant turn the conversation
  before it is rendered with the generation prompt (the assistant's header), and the
  conversation through it: the turn's tokens are those between the two, end-of-turn token
  included, and whatever the template writes after it before the next turn too. ChatML
  (``<|im_start|>assistant``, a newline, the response, ``<|im_end|>``, a newline) thus trains
  the newline after every ``<|im_end|>``, which the markers rule does not when the block ends
  at ``<|im_end|>``.
  The rule holds only if each rendering is a prefix of the next, which is checked: a
  template that rewrites earlier turns (some drop past reasoning) is refused, naming the
  turn, rather than trained on the wrong tokens.

``docs/chat_templates.md`` shows both on ChatML and how to add markers to a template.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from itertools import groupby
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


def has_generation_markers(template: str) -> bool:
    """Whether a chat template holds a ``{% generation %}`` statement (any whitespace control, ``{%- generation
    -%}`` too), found among the template's Jinja tokens, so that one in a comment, a raw block or a string is no
    marker."""
    import jinja2  # transformers renders chat templates with it

    tokens = [(kind, value) for _, kind, value in jinja2.Environment().lex(template) if kind != "whitespace"]
    return any(kind == "block_begin" and after == ("name", "generation")
               for (kind, _), after in zip(tokens, tokens[1:]))


class ChatTemplateFormat:
    """Conversations to ids with the tokenizer's chat template, the assistant's tokens marked as trained: those its
    ``{% generation %}`` blocks mark when it has them (``marked``), else each assistant turn's by prefixes (the
    module's docstring)."""

    def __init__(self, tokenizer: HFChatTokenizer) -> None:
        if not tokenizer.chat_template:
            raise ValueError(
                f"The tokenizer in {tokenizer.path} has no chat template, so conversations cannot be formatted with "
                f"it; pass prompt_style='plain' (or a dict of 'system', 'user' and 'assistant' templates) to write "
                f"them as plain text, or use a tokenizer that has one (an instruct model's)."
            )
        self.tokenizer = tokenizer
        self.marked = has_generation_markers(tokenizer.hf.get_chat_template())  # the one it renders with

    def _chat(self, messages: Sequence[Message]) -> list[dict]:
        return [{"role": m.role, "content": m.content} for m in messages]

    def _render(self, messages: Sequence[Message], generation_prompt: bool) -> list[int]:
        return list(self.tokenizer.hf.apply_chat_template(self._chat(messages), tokenize=True,
                                                          add_generation_prompt=generation_prompt, return_dict=False))

    def encode(self, messages: Sequence[Message]) -> Encoded:
        return self._by_markers(messages) if self.marked else self._by_prefixes(messages)

    def _by_markers(self, messages: Sequence[Message]) -> Encoded:
        """The ids and transformers' ``assistant_masks``; refused when they mark nothing or a marked span lacks the
        end-of-sequence id. A slow tokenizer is refused here, not when the format is made: prompts need no marks."""
        if not self.tokenizer.hf.is_fast:
            raise ValueError(
                f"The chat template of {self.tokenizer.path} marks the assistant's text with {{% generation %}} "
                f"blocks, whose tokens transformers finds from token offsets, which the slow tokenizer "
                f"{type(self.tokenizer.hf).__name__} does not give; save the directory with a fast tokenizer (a "
                f"tokenizer.json: AutoTokenizer.from_pretrained(...).save_pretrained(...) with `tokenizers` "
                f"installed), or remove the markers to train each assistant turn by prefixes."
            )
        rendered = self.tokenizer.hf.apply_chat_template(self._chat(messages), tokenize=True, return_dict=True,
                                                         return_assistant_tokens_mask=True)
        ids, trained = list(rendered["input_ids"]), [bool(m) for m in rendered["assistant_masks"]]
        where = f"the conversation starting {messages[0].content[:40]!r} ({len(messages)} messages)"
        fix = ("put {% generation %} before each assistant message's content and {% endgeneration %} after its "
               "end-of-turn token, e.g. <|im_start|>assistant\\n{% generation %}{{ message['content'] }}<|im_end|>"
               "{% endgeneration %}\\n")
        if not any(trained):
            raise ValueError(f"The chat template of {self.tokenizer.path} has {{% generation %}} markers, but they "
                             f"mark none of the tokens of {where}, so it has nothing to learn: {fix}.")
        start = 0
        for flag, run in groupby(trained):  # each span of marked tokens must hold the end-of-sequence id
            stop = start + len(list(run))
            if flag and self.tokenizer.eos_id not in ids[start:stop]:
                text = self.tokenizer.hf.decode(ids[start:stop], skip_special_tokens=False)
                raise ValueError(
                    f"The chat template of {self.tokenizer.path} marks {text!r} in {where} as the assistant's, without "
                    f"the end-of-sequence token {self.tokenizer.hf.eos_token!r}, so the model would not learn to stop: "
                    f"{fix} (or set the tokenizer's eos_token to the marker its turns end with).")
            start = stop
        return Encoded(ids, trained)

    def _by_prefixes(self, messages: Sequence[Message]) -> Encoded:
        """Each assistant turn's tokens: those between the rendering before it (with the generation prompt) and the
        rendering through it."""
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
                    f"tokens cannot be told apart; use prompt_style='plain' or a template that only appends turns "
                    f"(or marks the assistant's text with {{% generation %}} blocks)."
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
        """What the ids and their flags depend on besides the tokenizer's vocabulary (a cache key's part): the
        template and its rule."""
        return {"chat_template": self.tokenizer.chat_template,
                "trained": "generation markers" if self.marked else "prefixes"}
