"""Tokenizers: the built-in byte tokenizer, Hugging Face ``tokenizer.json`` files, and BPE and WordPiece training.

Everything that turns text into ids goes through the small :class:`Tokenizer` protocol, so
preprocessing and the data modules work the same with any of them. The Hugging Face
``tokenizers`` library is optional (``pip install 'lightning-megatron[hf]'``) and imported
only when a ``tokenizer.json`` is loaded or trained; the byte tokenizer needs nothing.

Two kinds are trained here, offline: a byte-level BPE for GPT (:func:`train_bpe_tokenizer`)
and a BERT-style WordPiece (:func:`train_wordpiece_tokenizer`), whose ``[PAD] [CLS] [SEP]
[MASK]`` the BERT data module reads from the file, as it does from a ``tokenizer.json`` saved
by transformers' ``BertTokenizerFast``. A WordPiece vocabulary has no end-of-document token of
its own: its ``[SEP]`` separates documents (``--append-eos`` appends it).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Protocol, runtime_checkable

from lightning_megatron.data.corpus import ByteTokenizer

#: The end-of-document token that :func:`train_bpe_tokenizer` adds (GPT-2's spelling).
DEFAULT_EOS_TOKEN = "<|endoftext|>"
#: BERT's special tokens, as :func:`train_wordpiece_tokenizer` writes them (ids 0 to 4) and BERT's vocabularies
#: spell them.
BERT_SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
# End-of-document tokens of common tokenizer.json files, tried in order when none is named:
# GPT-2 and ours, Llama 3, Llama 2 / T5 / BART, Gemma, and last BERT's WordPiece, whose [SEP]
# separates documents.
_KNOWN_EOS_TOKENS = (DEFAULT_EOS_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "[SEP]")


@runtime_checkable
class Tokenizer(Protocol):
    """What preprocessing and the data modules need from a tokenizer.

    ``vocab_size`` counts every id the tokenizer can produce (special tokens included), so a
    model whose embedding has at least that many rows can take all of its output.
    """

    vocab_size: int
    eos_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...


def _import_tokenizers() -> ModuleType:
    try:
        import tokenizers
    except ImportError as error:
        raise ImportError(
            "Hugging Face tokenizer files need the optional `tokenizers` package: "
            "pip install 'lightning-megatron[hf]'  (or use the built-in tokenizer: 'byte')."
        ) from error
    return tokenizers


class HFTokenizer:
    """A Hugging Face ``tokenizer.json``, read with the ``tokenizers`` library.

    Args:
        path: the ``tokenizer.json`` file.
        eos_token: the end-of-document token; by default the first of ``<|endoftext|>``,
            ``<|end_of_text|>``, ``</s>``, ``<eos>``, ``[SEP]`` that the vocabulary has.

    ``encode`` adds no special tokens (documents are separated by ``eos_id`` when packed);
    ``decode`` drops them. BERT's special ids (``pad_id``, ``cls_id``, ``sep_id``, ``mask_id``)
    are those of ``[PAD] [CLS] [SEP] [MASK]``, ``None`` where the vocabulary lacks the token;
    ``special_ids`` are the ids of all the file's special tokens.

    Example::

        >>> tok = HFTokenizer("tokenizer.json")      # doctest: +SKIP
        >>> tok.decode(tok.encode("def f(x):"))      # doctest: +SKIP
        'def f(x):'
    """

    def __init__(self, path: str | os.PathLike, *, eos_token: str | None = None) -> None:
        tokenizers = _import_tokenizers()
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"Tokenizer file {self.path} does not exist.")
        self._tokenizer = tokenizers.Tokenizer.from_file(str(self.path))
        candidates = (eos_token,) if eos_token is not None else _KNOWN_EOS_TOKENS
        ids = [self._tokenizer.token_to_id(token) for token in candidates]
        found = [(token, i) for token, i in zip(candidates, ids) if i is not None]
        if not found:
            raise ValueError(
                f"{self.path} has none of the end-of-document tokens {list(candidates)}; pass "
                f"HFTokenizer(path, eos_token=...) with the token its documents end with."
            )
        self.eos_token, self.eos_id = found[0]
        self.vocab_size: int = self._tokenizer.get_vocab_size(with_added_tokens=True)
        added = self._tokenizer.get_added_tokens_decoder()
        #: Ids of the special tokens ([UNK], end of document, BERT's, ...), which are no ordinary text.
        self.special_ids = frozenset(i for i, token in added.items() if token.special)
        self.pad_id, _, self.cls_id, self.sep_id, self.mask_id = map(self._tokenizer.token_to_id, BERT_SPECIAL_TOKENS)

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """``encode`` of each text, in one call into the library (which threads the batch over all cores unless
        ``TOKENIZERS_PARALLELISM=false``, as ``preprocess`` sets it while it runs)."""
        return [encoding.ids for encoding in self._tokenizer.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)


def encode_batch(tokenizer: Tokenizer, texts: Sequence[str]) -> list[list[int]]:
    """``tokenizer.encode`` of each text, in one call for a tokenizer that encodes batches (Hugging Face's)."""
    if isinstance(tokenizer, HFTokenizer):
        return tokenizer.encode_batch(texts)
    return [tokenizer.encode(text) for text in texts]


def load_tokenizer(spec: str | os.PathLike) -> Tokenizer:
    """``"byte"`` for :class:`ByteTokenizer`, else the path of a Hugging Face ``tokenizer.json``.

    Example::

        >>> load_tokenizer("byte").vocab_size
        257
    """
    if os.fspath(spec) == "byte":
        return ByteTokenizer()
    if not Path(spec).is_file():
        raise FileNotFoundError(
            f"Tokenizer {os.fspath(spec)!r} is neither 'byte' nor an existing tokenizer.json file; "
            f"train one with `lightning-megatron train-tokenizer`."
        )
    return HFTokenizer(spec)


def check_vocab_fits(*, tokenizer_vocab_size: int, model_vocab_size: int) -> None:
    """Fail when the tokenizer can produce ids that the model's embedding has no row for.

    A larger model vocabulary is fine (Megatron pads it for tensor parallelism); a smaller one
    would index out of range on the first batch that holds a high id, usually deep inside an
    embedding kernel with an unhelpful message, so the sizes are compared up front.
    """
    if tokenizer_vocab_size > model_vocab_size:
        raise ValueError(
            f"The tokenizer has {tokenizer_vocab_size} ids but the model's vocab_size is {model_vocab_size}: ids "
            f"{model_vocab_size}..{tokenizer_vocab_size - 1} have no embedding row. Build the model with "
            f"vocab_size >= {tokenizer_vocab_size} (e.g. GPTConfig(vocab_size=datamodule.vocab_size)) or use the "
            f"tokenizer the model was made for."
        )


def train_bpe_tokenizer(
    texts: Iterable[str],
    *,
    vocab_size: int,
    output_path: str | os.PathLike,
    eos_token: str = DEFAULT_EOS_TOKEN,
) -> HFTokenizer:
    """Train a byte-level BPE tokenizer on ``texts`` offline and save it as a ``tokenizer.json``.

    Byte-level (as GPT-2) means the 256 byte values are in the vocabulary from the start, so
    any text is encodable and nothing maps to an unknown token; ``eos_token`` is added as a
    special token that separates documents.

    Example::

        >>> tok = train_bpe_tokenizer(["def f(x): return x"] * 100, vocab_size=300,
        ...                           output_path="tokenizer.json")  # doctest: +SKIP
    """
    tokenizers = _import_tokenizers()
    minimum = 256 + 1
    if vocab_size < minimum:
        raise ValueError(
            f"vocab_size={vocab_size} is too small for a byte-level BPE: it needs at least {minimum} ids "
            f"(256 bytes and {eos_token!r})."
        )
    byte_level = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[eos_token],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    _train_and_save(tokenizer, trainer, texts, output_path)
    return HFTokenizer(output_path, eos_token=eos_token)


def train_wordpiece_tokenizer(
    texts: Iterable[str],
    *,
    vocab_size: int,
    output_path: str | os.PathLike,
    lowercase: bool = False,
) -> HFTokenizer:
    """Train a BERT-style WordPiece tokenizer on ``texts`` offline and save it as a ``tokenizer.json``.

    As BERT's: the normalizer cleans control characters, spaces out CJK characters and, with
    ``lowercase``, lowercases and strips accents (an "uncased" vocabulary); the pre-tokenizer
    splits at whitespace and punctuation; word pieces after the first carry ``##``. The
    special tokens ``[PAD] [UNK] [CLS] [SEP] [MASK]`` get ids 0 to 4, and the file's
    post-processor adds ``[CLS] A [SEP] B [SEP]`` as transformers' ``BertTokenizerFast`` does
    (``HFTokenizer.encode`` adds nothing). Characters never seen in ``texts`` become ``[UNK]``.
    The end-of-document id of the returned tokenizer is ``[SEP]``'s.

    Example::

        >>> tok = train_wordpiece_tokenizer(["The cat sat on the mat."] * 100, vocab_size=200,
        ...                                 output_path="tokenizer.json")  # doctest: +SKIP
        >>> tok.cls_id, tok.sep_id, tok.mask_id                                # doctest: +SKIP
        (2, 3, 4)
    """
    tokenizers = _import_tokenizers()
    minimum = len(BERT_SPECIAL_TOKENS) + 1
    if vocab_size < minimum:
        raise ValueError(f"vocab_size={vocab_size} is too small for a WordPiece vocabulary: it needs at least {minimum} "
                         f"ids ({', '.join(BERT_SPECIAL_TOKENS)} and a piece of text).")
    unk, cls, sep = BERT_SPECIAL_TOKENS[1:4]
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordPiece(unk_token=unk))
    tokenizer.normalizer = tokenizers.normalizers.BertNormalizer(lowercase=lowercase)
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = tokenizers.decoders.WordPiece()
    tokenizer.post_processor = tokenizers.processors.TemplateProcessing(
        single=f"{cls} $A {sep}", pair=f"{cls} $A {sep} $B:1 {sep}:1",
        special_tokens=[(cls, 2), (sep, 3)],
    )
    trainer = tokenizers.trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=list(BERT_SPECIAL_TOKENS),
                                                   show_progress=False)
    _train_and_save(tokenizer, trainer, texts, output_path)
    return HFTokenizer(output_path, eos_token=sep)


def _train_and_save(tokenizer, trainer, texts: Iterable[str], output_path: str | os.PathLike) -> None:
    """Train ``tokenizer`` on ``texts`` and write it to ``output_path`` under a temporary name, then renamed, so an
    interrupted run never leaves a broken tokenizer behind."""
    texts_seen = 0

    def counted(texts: Iterable[str]) -> Iterable[str]:
        nonlocal texts_seen
        for text in texts:
            texts_seen += bool(text)
            yield text

    tokenizer.train_from_iterator(counted(texts), trainer)
    output_path = Path(output_path)
    if not texts_seen:  # it would be a tokenizer of the bare alphabet, trained on nothing
        raise ValueError(f"No text to train a tokenizer on (every text was empty); nothing was written to {output_path}.")
    tmp = output_path.with_name(output_path.name + ".tmp")
    tokenizer.save(str(tmp))
    os.replace(tmp, output_path)
