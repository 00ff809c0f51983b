"""Plain-text prompt styles: how a conversation is written out for a tokenizer without a chat template.

The built-in byte tokenizer has no chat template, so conversations are written in a small,
readable style (``"plain"``)::

    System: You answer in one word.
    User: Reverse the letters of cat.
    Assistant: Answer: tac<EOS>User: ...

Each turn is tokenised on its own and the pieces are concatenated; an assistant turn is
followed by the tokenizer's end-of-sequence id, which is trained on as the response's last
token, so that a model learns to stop. The text up to ``"Assistant: "`` is the prompt, which
generation continues (:meth:`PromptStyleFormat.prompt`), so that a fine-tuned model is asked
in the format it was taught. A custom style is a dict of the three templates, each holding
``{content}`` once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Optional, Union

from lightning_megatron.data.conversations import Encoded, Message
from lightning_megatron.data.tokenizers import Tokenizer

_FIELD = "{content}"


@dataclass(frozen=True)
class PromptStyle:
    """The text of each role's turn around its ``{content}``; the user's ends with the assistant's header."""

    system: str = "System: {content}\n"
    user: str = "User: {content}\nAssistant: "
    assistant: str = "{content}"

    def __post_init__(self) -> None:
        for role in ("system", "user", "assistant"):
            if getattr(self, role).count(_FIELD) != 1:
                raise ValueError(f"The prompt style's {role} template {getattr(self, role)!r} must hold {_FIELD} "
                                 f"exactly once.")

    @classmethod
    def of(cls, style: Union[str, dict, "PromptStyle"]) -> "PromptStyle":
        """A style by name (:data:`PROMPT_STYLES`), from a dict of templates, or as it is."""
        if isinstance(style, PromptStyle):
            return style
        if isinstance(style, dict):
            unknown = set(style) - {"system", "user", "assistant"}
            if unknown:
                raise ValueError(f"Unknown prompt style keys {sorted(unknown)}; a style sets 'system', 'user' and "
                                 f"'assistant' templates, each holding {_FIELD}.")
            return cls(**style)
        if style not in PROMPT_STYLES:
            raise ValueError(f"Unknown prompt_style={style!r}; the built-in styles are {sorted(PROMPT_STYLES)}, or "
                             f"give a dict of 'system', 'user' and 'assistant' templates holding {_FIELD}.")
        return PROMPT_STYLES[style]

    def text(self, message: Message) -> str:
        return getattr(self, message.role).replace(_FIELD, message.content)


PROMPT_STYLES = {"plain": PromptStyle()}


class PromptStyleFormat:
    """Conversations to ids through a :class:`PromptStyle` and a tokenizer's ``encode`` (no special tokens).

    ``bos_id``: prepended to every conversation when the tokenizer has one (Llama's), as its own
    tokenizer would when it encodes a text.
    """

    def __init__(self, style: PromptStyle, tokenizer: Tokenizer, bos_id: Optional[int] = None) -> None:
        self.style, self.tokenizer, self.bos_id = style, tokenizer, bos_id

    def encode(self, messages: Sequence[Message]) -> Encoded:
        ids, trained = ([self.bos_id], [False]) if self.bos_id is not None else ([], [])
        for message in messages:
            piece = self.tokenizer.encode(self.style.text(message))
            response = message.role == "assistant"
            if response:
                piece = piece + [self.tokenizer.eos_id]
            ids += piece
            trained += [response] * len(piece)
        return Encoded(ids, trained)

    def prompt(self, messages: Sequence[Message]) -> list[int]:
        """The ids of ``messages`` (ending with a user turn) up to where the assistant's response starts."""
        return self.encode(messages).ids

    def identity(self) -> dict:
        """What the ids depend on besides the tokenizer's vocabulary (a cache key's part)."""
        return {"prompt_style": asdict(self.style), "bos_id": self.bos_id, "eos_id": self.tokenizer.eos_id}
