"""Supervised fine-tuning data: conversations with the loss on the responses only, split over dp ranks.

The rows (``data/conversations.py``) are tokenised with the model's Hugging Face tokenizer
and its chat template (``data/chat_templates.py``) or written in a plain prompt style for the
byte tokenizer (``data/prompt_styles.py``), fitted to the sequence and optionally packed
(``data/sft_dataset.py``). Splitting, batching, sampling and resuming are the pretraining
data's (``data/base.py``): the samples of global batch k are the same set at any dp, and a
run resumes mid-epoch without repeating or skipping any.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader, Dataset

from lightning_megatron.data.base import TokenDataModule
from lightning_megatron.data.chat_templates import ChatTemplateFormat, HFChatTokenizer
from lightning_megatron.data.conversations import (Conversation, Encoded, Message, check_data_file, check_turns,
                                                   message, read_conversations)
from lightning_megatron.data.corpus import ByteTokenizer, index_cache_dir
from lightning_megatron.data.index_cache import Ranks
from lightning_megatron.data.instructions import BUILTIN_SOURCE, instruction_set
from lightning_megatron.data.prompt_styles import PromptStyle, PromptStyleFormat
from lightning_megatron.data.prompts import PromptDataset
from lightning_megatron.data.sft_dataset import OVERLONG, SFTDataset, fit_to_window
from lightning_megatron.data.sft_tokens import file_identity, tokenised_conversations, tokenizer_identity
from lightning_megatron.data.splits import SPLIT_NAMES, enlarged_split
from lightning_megatron.data.tokenizers import Tokenizer, load_tokenizer

#: A prompt for ``trainer.predict``: a user message, a conversation ending with a user turn, or token ids.
PredictPrompt = Union[str, list[dict], list[int]]


class SFTDataModule(TokenDataModule):
    """Conversations to fine-tune on, the loss only on the assistant's tokens (``-100`` elsewhere).

    Args:
        data_path: a ``.jsonl`` or ``.parquet`` file of ``{"prompt", "response"}`` rows or chat rows
            ``{"messages": [{"role", "content"}, ...]}``; by default the built-in instruction set
            (``data/instructions.py``), made in memory.
        tokenizer: ``"byte"`` (no download), a Hugging Face tokenizer directory (needs ``transformers``), or a
            ``tokenizer.json``. ``None`` (the default): the tokenizer of the trainer's model's ``pretrained``
            directory when it holds one (``GPT(pretrained=...)``: the model is fine-tuned with the tokenizer it
            was trained with, and its chat template), else ``"byte"``; chosen when the trainer is attached. A
            model whose vocabulary does not fit the tokenizer is refused in ``setup``, naming both sizes.
        prompt_style: how conversations are written out: ``None`` for the tokenizer's chat template
            (``"plain"`` for the byte tokenizer), ``"plain"``, or a dict of ``system``, ``user`` and
            ``assistant`` templates holding ``{content}`` (``data/prompt_styles.py``). A chat template's
            trained tokens are those its ``{% generation %}`` blocks mark (transformers' assistant masks)
            when it has them, else each assistant turn with what the template writes after it up to the
            next turn (ChatML's newline after ``<|im_end|>`` too): ``data/chat_templates.py``,
            ``docs/chat_templates.md``.
        seq_length: positions per sample; every sample has exactly this many (padded).
        global_batch_size: samples per optimizer step over all data-parallel ranks.
        packing: several conversations per sample, each with its own positions and attention
            (``position_ids``, ``document_ids``); one per sample otherwise.
        overlong: a conversation longer than ``seq_length + 1`` tokens is cut (``"truncate"``: its
            end goes) or left out (``"drop"``); the counts are warned about once.
        split: train, validation and test weights of the conversations, after a seeded shuffle.
        seed: seed of that shuffle (and of the packing order, which follows it) and of the training sampler.
        num_workers: DataLoader worker processes.
        predict_prompts: prompts for ``trainer.predict``, written up to where the response starts, so
            generation continues in the taught format: user messages, conversations ending with a user
            turn, token-id lists, or ``"validation"`` / ``"test"``: the prompts of that split's
            conversations (their last response is what :meth:`held_out` gives to check against).
        generation: the generation settings (``data/prompts.py``); ``eos_id`` defaults to the tokenizer's.
        index_cache_dir: where the tokenised conversations are cached (``data/sft_tokens.py``); by default
            ``index_cache`` beside ``data_path`` when that is writable, else under ``$LIGHTNING_MEGATRON_CACHE``.

    Example::

        trainer.fit(model, datamodule=SFTDataModule(seq_length=64, packing=True))
        trainer.fit(model, datamodule=SFTDataModule(data_path="chats.jsonl", tokenizer="hf_model_dir"))
    """

    def __init__(
        self,
        *,
        data_path: Optional[str] = None,
        tokenizer: Optional[str] = None,
        prompt_style: Optional[Union[str, dict]] = None,
        seq_length: int = 128,
        global_batch_size: int = 16,
        packing: bool = False,
        overlong: str = "truncate",
        split: str = "95,5,0",
        seed: int = 1234,
        num_workers: int = 0,
        predict_prompts: Optional[Union[str, list[PredictPrompt]]] = None,
        generation: Optional[dict] = None,
        index_cache_dir: Optional[str] = None,
    ) -> None:
        super().__init__(global_batch_size=global_batch_size, split=split, seed=seed, num_workers=num_workers)
        if seq_length < 1:
            raise ValueError(f"seq_length must be at least 1, got {seq_length}.")
        if overlong not in OVERLONG:
            raise ValueError(f"overlong={overlong!r} must be one of {OVERLONG}.")
        if isinstance(predict_prompts, str) and predict_prompts not in SPLIT_NAMES[1:]:
            raise ValueError(f"predict_prompts={predict_prompts!r} must be a list of prompts or the name of a held-out "
                             f"split: 'validation' or 'test'.")
        if data_path is not None:
            check_data_file(data_path)
        self.data_path, self.seq_length, self.packing, self.overlong = data_path, seq_length, packing, overlong
        self.tokenizer_spec, self.prompt_style = tokenizer, prompt_style
        self._chosen: Optional[tuple[str, Tokenizer, ConversationFormat]] = None  # (spec, its tokenizer and format)
        if tokenizer is not None:
            self._choose()  # a bad tokenizer or style fails when the module is made
        self.generation, self.predict_prompts, self.index_cache_dir = generation, predict_prompts, index_cache_dir
        self._encoded: Optional[list[Encoded]] = None  # every conversation, tokenised, in the seeded order
        self._order: Optional[np.ndarray] = None  # the file row of each place in that order
        self._ranges: dict[str, range] = {}
        self._fitting: dict[str, tuple[int, int, int]] = {}  # split -> (conversations, truncated, dropped)
        self._given_prompts = ([_prompt_turns(p) for p in predict_prompts]  # checked now, written with the tokenizer
                               if predict_prompts and not isinstance(predict_prompts, str) else None)

    # ------------------------------------------------------------------ the tokenizer
    def _model_pretrained(self) -> Optional[str]:
        """The ``pretrained`` directory of the trainer's model, if it has one (any module with that attribute)."""
        module = getattr(self.trainer, "lightning_module", None) if self.trainer is not None else None
        pretrained = getattr(module, "pretrained", None)
        return os.fspath(pretrained) if pretrained is not None else None

    def tokenizer_choice(self) -> str:
        """The tokenizer used: ``tokenizer`` as given, else the model's ``pretrained`` directory when it holds a
        tokenizer, else ``"byte"``."""
        if self.tokenizer_spec is not None:
            return os.fspath(self.tokenizer_spec)
        pretrained = self._model_pretrained()
        return pretrained if pretrained is not None and holds_tokenizer(pretrained) else "byte"

    def _choose(self) -> tuple[str, Tokenizer, ConversationFormat]:
        """The tokenizer of :meth:`tokenizer_choice` and the format: ``prompt_style``, else its chat template. A
        pretrained directory's tokenizer, taken by default, without a chat template (a base model's) writes the
        plain style, which the setup's summary line names; one given as ``tokenizer`` must have one."""
        spec = self.tokenizer_choice()
        if self._chosen is None or self._chosen[0] != spec:
            tokenizer = load_sft_tokenizer(spec)
            style = self.prompt_style
            if style is None and self.tokenizer_spec is None and not getattr(tokenizer, "chat_template", True):
                style = "plain"
            self._chosen = (spec, tokenizer, conversation_format(tokenizer, spec, style))
        return self._chosen

    @property
    def tokenizer(self) -> Tokenizer:
        return self._choose()[1]

    @property
    def format(self) -> ConversationFormat:
        """How conversations are written: the tokenizer's chat template or a prompt style."""
        return self._choose()[2]

    def check_model(self, config: Any) -> None:
        """As for any token data (the ids fit the model's vocabulary, the samples its context), and a model made
        from ``pretrained`` is fine-tuned with the tokenizer it was trained with: the byte tokenizer for a model of
        another vocabulary, or another tokenizer than the one in its directory with another number of ids, is
        refused, naming both sizes."""
        pretrained = self._model_pretrained()
        if pretrained is not None:
            check_pretrained_tokenizer(pretrained, self.tokenizer_choice(), self.tokenizer.vocab_size,
                                       model_vocab_size=getattr(config, "vocab_size", None))
        super().check_model(config)

    def data_source(self) -> str:
        return f"data_path={self.data_path!r}" if self.data_path is not None else "the built-in instruction set"

    # ------------------------------------------------------------------ conversations and datasets
    def _read(self) -> list[Conversation]:
        """Every row, checked (a malformed one fails, naming its place), in the file's order."""
        return read_conversations(self.data_path) if self.data_path is not None else instruction_set()

    def open_corpus(self) -> int:
        """Every conversation tokenised (from the cache, built by one rank), in a seeded order, which the split's
        contiguous ranges then cut: a file sorted by topic still gives every split some of each."""
        if self._encoded is None:
            source = file_identity(self.data_path) if self.data_path is not None else BUILTIN_SOURCE
            encoded = tokenised_conversations(
                self._read, self.format.encode, source=source,
                format_identity={**self.format.identity(), "tokenizer": tokenizer_identity(self.tokenizer)},
                cache_dir=index_cache_dir(self.data_path, self.index_cache_dir), ranks=Ranks.of_trainer(self.trainer))
            self._order = np.random.default_rng(self.seed).permutation(len(encoded))
            self._encoded = [encoded[i] for i in self._order]
        return len(self._encoded)

    def make_dataset(self, split: str, documents: range, num_samples: Optional[int]) -> Dataset:
        """The split's conversations, fitted to the window and packed; one pass over them is an epoch (the training
        sampler reshuffles the samples every epoch)."""
        self._ranges[split] = documents
        encoded = [self._encoded[i] for i in documents]
        fitted = fit_to_window(encoded, self.seq_length + 1, self.overlong)
        self._fitting[split] = (len(encoded), fitted.truncated, fitted.dropped)
        if encoded and not fitted.encoded:
            raise ValueError(f"None of the {len(encoded)} conversations of the {split} split fits seq_length + 1 = "
                             f"{self.seq_length + 1} tokens with a response token left (overlong={self.overlong!r}); "
                             f"the shortest holds {min(len(e.ids) for e in encoded)}: use a longer seq_length.")
        return SFTDataset(fitted.encoded, seq_length=self.seq_length, pad_id=self.tokenizer.eos_id, packing=self.packing)

    def setup(self, stage: Optional[str] = None) -> None:
        fresh = self.train_dataset is None and stage != "predict"
        super().setup(stage)
        if fresh:
            self._report()

    def _report(self) -> None:
        """Say once (rank zero) how the conversations fitted; warn with the counts when any was too long."""
        total, truncated, dropped = (sum(counts[i] for counts in self._fitting.values()) for i in range(3))
        if truncated or dropped:
            action = (f"{truncated} truncated (their ends cut), {dropped} dropped (no response token fits)"
                      if self.overlong == "truncate" else f"{dropped} dropped")
            rank_zero_warn(f"{truncated + dropped} of {total} conversations ({self.data_source()}) are longer than "
                           f"seq_length + 1 = {self.seq_length + 1} tokens: {action} (overlong={self.overlong!r}). "
                           f"A longer seq_length keeps them whole.")
        real, room = self.train_dataset.tokens()
        spec = self.tokenizer_choice()
        if isinstance(self.format, ChatTemplateFormat):
            written = ("its chat template, trained where its {% generation %} blocks mark" if self.format.marked else
                       "its chat template, each assistant turn found by prefixes (no {% generation %} markers)")
        else:
            written = f"the prompt style {self.prompt_style or 'plain'!r}"
        chosen = " (the model's pretrained directory)" if self.tokenizer_spec is None and spec != "byte" else ""
        rank_zero_info(f"SFT data: {total} conversations, {len(self.train_dataset)} training samples of "
                       f"{self.seq_length} ({'packed' if self.packing else 'one conversation each'}, "
                       f"{real / room:.0%} of their tokens real); tokenizer {spec!r}{chosen}, {written}.")

    # ------------------------------------------------------------------ prediction
    @property
    def prompts(self) -> Optional[PromptDataset]:
        """The given ``predict_prompts``, written as the conversations are, up to where the response starts."""
        if self._given_prompts is None:
            return None
        return PromptDataset([p if _is_ids(p) else self.format.prompt(p) for p in self._given_prompts],
                             self.tokenizer, self.generation)

    def conversations(self, split: str) -> list[Conversation]:
        """The conversations of ``split`` (``"train"``, ``"validation"`` or ``"test"``), in the split's order, read
        again from the data."""
        if split not in SPLIT_NAMES:
            raise ValueError(f"split={split!r} is none of {SPLIT_NAMES}.")
        if self.train_dataset is None:
            self.setup("fit")
        rows = self._read()
        return [rows[self._order[i]] for i in self._ranges.get(split, ())]

    def held_out(self, split: str = "validation") -> list[tuple[Conversation, str]]:
        """Each conversation of a held-out ``split`` as ``(its messages before the last response, that response)``,
        in the split's order: the prompts of ``predict_prompts=split`` and what they should be answered with."""
        if split not in SPLIT_NAMES[1:]:
            raise ValueError(f"held_out(split={split!r}) needs a held-out split: 'validation' or 'test'.")
        return [(c[:-1], c[-1].content) for c in self.conversations(split)]

    def predict_dataloader(self) -> DataLoader:
        """The prompts, in order, ``per_rank_batch_size`` at a time (Lightning splits them over dp)."""
        prompts = self.prompts
        if isinstance(self.predict_prompts, str):
            held_out = self.held_out(self.predict_prompts)
            if not held_out:
                raise ValueError(f"predict_prompts={self.predict_prompts!r}, but split={self.split!r} gives that "
                                 f"split no conversation; give it a weight, e.g. split="
                                 f"{enlarged_split(self.split, self.predict_prompts, 1)!r}.")
            prompts = PromptDataset([self.format.prompt(turns) for turns, _ in held_out], self.tokenizer,
                                    self.generation)
        if prompts is None:
            raise ValueError("trainer.predict needs prompts: SFTDataModule(predict_prompts=['...'] or 'validation', "
                             "generation={'max_new_tokens': 32}) (or --data.predict_prompts on the command line).")
        return DataLoader(prompts, batch_size=self.per_rank_batch_size, collate_fn=prompts.collate, shuffle=False)


def _is_ids(prompt: Union[list[Message], list[int]]) -> bool:
    return bool(prompt) and all(isinstance(item, int) for item in prompt)


def _prompt_turns(prompt: PredictPrompt) -> Union[list[Message], list[int]]:
    """A predict prompt as the turns to write (a user message: one user turn), or its token ids as they are;
    checked: the turns alternate and end with a user turn."""
    if isinstance(prompt, str):
        return [Message("user", prompt)]
    if _is_ids(prompt):
        return list(prompt)
    turns = [message(m, i) for i, m in enumerate(prompt)]
    check_turns([*turns, Message("assistant", "the response to generate")])  # alternating, ending with a user turn
    return turns


def holds_tokenizer(directory: str) -> bool:
    """Whether a Hugging Face ``save_pretrained`` directory holds a tokenizer (``tokenizer_config.json`` or
    ``tokenizer.json``)."""
    return any((Path(directory) / name).is_file() for name in ("tokenizer_config.json", "tokenizer.json"))


def check_pretrained_tokenizer(pretrained: str, spec: str, vocab_size: int, *,
                               model_vocab_size: Optional[int]) -> None:
    """Refuse a tokenizer (``spec``, ``vocab_size`` ids) that is not the one the model in ``pretrained`` was trained
    with: the byte tokenizer for a model of another vocabulary size, or a tokenizer with another number of ids
    than the one in the directory."""
    own = holds_tokenizer(pretrained)
    unset = ("leave tokenizer unset (no --data.init_args.tokenizer): its default is the tokenizer in the pretrained "
             "directory" if own else f"pass tokenizer (--data.init_args.tokenizer) the tokenizer directory or "
             f"tokenizer.json the model was trained with ({pretrained} holds none)")
    if spec == "byte" and model_vocab_size is not None and model_vocab_size != vocab_size:
        raise ValueError(f"The model pretrained={pretrained!r} has a vocabulary of {model_vocab_size} ids, but the "
                         f"tokenizer 'byte' has {vocab_size}: the model was trained with another tokenizer, and byte "
                         f"ids would mean nothing to it. {unset[0].upper() + unset[1:]}.")
    if own and spec != "byte" and Path(spec).resolve() != Path(pretrained).resolve():
        expected = HFChatTokenizer(pretrained).vocab_size
        if expected != vocab_size:
            raise ValueError(f"tokenizer={spec!r} has {vocab_size} ids, but the model pretrained={pretrained!r} was "
                             f"trained with the tokenizer in that directory, which has {expected}; {unset}, or pass "
                             f"the tokenizer the model was trained with.")


def load_sft_tokenizer(spec: str) -> Tokenizer:
    """``"byte"``, a Hugging Face tokenizer directory (with its chat template), or a ``tokenizer.json`` file."""
    if os.fspath(spec) == "byte" or Path(spec).is_file():
        return load_tokenizer(spec)
    if Path(spec).is_dir():
        return HFChatTokenizer(spec)
    raise FileNotFoundError(f"tokenizer={os.fspath(spec)!r} is neither 'byte', a Hugging Face tokenizer directory nor a "
                            f"tokenizer.json file.")


#: How conversations are written out: a tokenizer's chat template or a plain prompt style.
ConversationFormat = Union[ChatTemplateFormat, PromptStyleFormat]


def conversation_format(tokenizer: Tokenizer, spec: str,
                        prompt_style: Optional[Union[str, dict]]) -> ConversationFormat:
    """The tokenizer's chat template, or ``prompt_style`` (``"plain"`` by default for the byte tokenizer): how
    conversations are written, for training and for the prompts generation continues (``lightning-megatron generate
    --prompt-style``)."""
    if prompt_style is None and isinstance(tokenizer, HFChatTokenizer):
        return ChatTemplateFormat(tokenizer)
    if prompt_style is None and not isinstance(tokenizer, ByteTokenizer):
        raise ValueError(f"tokenizer={spec!r} is a tokenizer.json file, which holds no chat template; pass "
                         f"prompt_style='plain' (or a dict of templates), or the Hugging Face tokenizer directory.")
    return PromptStyleFormat(PromptStyle.of(prompt_style or "plain"), tokenizer, getattr(tokenizer, "bos_id", None))
