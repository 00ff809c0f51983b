"""What a ``save_pretrained`` directory holds beside the model: the tokenizer's files and ``generation_config.json``.

An export of a fine-tuned model (``lightning-megatron checkpoint convert``) is used the way its base was:
``AutoTokenizer.from_pretrained(out)``, ``model.generate`` (which stops at ``generation_config.json``'s
``eos_token_id``) and ``lightning-megatron generate --checkpoint out`` read these files from the model's own
directory. Fine-tuning changes the weights, never the tokenizer, so they are the base's: its tokenizer files are
copied, and its special token ids (``bos``/``eos``/``pad``) go into the export's ``config.json`` and
``generation_config.json``. The ids come from the base's ``config.json``, else its ``generation_config.json``, else
its tokenizer (the ``bos_token``/``eos_token``/``pad_token`` of ``tokenizer_config.json``, looked up in the
tokenizer's own files, no ``transformers`` needed).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Optional, Union

from lightning_megatron.checkpoint.replacement import write_atomically

#: The files ``PreTrainedTokenizer.save_pretrained`` writes, fast and slow tokenizers of the common families.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt",
                   "vocab.txt", "spiece.model", "sentencepiece.bpe.model")
GENERATION_CONFIG = "generation_config.json"
SPECIAL_TOKENS = ("bos", "eos", "pad")

PathLike = Union[str, os.PathLike]


def tokenizer_files(directory: PathLike) -> list[Path]:
    """The tokenizer files in ``directory`` (none: it holds no tokenizer)."""
    return [Path(directory) / name for name in TOKENIZER_FILES if (Path(directory) / name).is_file()]


def _json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_text(token: Any) -> Optional[str]:
    """A ``tokenizer_config.json`` token: a string, or an ``AddedToken`` dict with its ``content``."""
    return token.get("content") if isinstance(token, dict) else token


def _token_ids(directory: Path) -> dict[str, int]:
    """Every token the tokenizer files name, with its id: added tokens and the model's vocabulary."""
    config, fast = _json(directory / "tokenizer_config.json"), _json(directory / "tokenizer.json")
    ids: dict[str, int] = {}
    vocab = (fast.get("model") or {}).get("vocab")
    if isinstance(vocab, dict):  # BPE, WordPiece, WordLevel (a Unigram vocabulary is a list of pieces and scores)
        ids.update(vocab)
    elif isinstance(vocab, list):
        ids.update({piece[0]: index for index, piece in enumerate(vocab)})
    ids.update({token["content"]: token["id"] for token in fast.get("added_tokens", [])})
    ids.update({token["content"]: int(index) for index, token in (config.get("added_tokens_decoder") or {}).items()})
    return ids


def special_token_ids(base: PathLike) -> dict[str, Any]:
    """``bos_token_id``/``eos_token_id``/``pad_token_id`` of the base directory (see the module), those it knows."""
    base = Path(base)
    found: dict[str, Any] = {}
    for source in (_json(base / "config.json"), _json(base / GENERATION_CONFIG)):
        for name in SPECIAL_TOKENS:
            if found.get(f"{name}_token_id") is None and source.get(f"{name}_token_id") is not None:
                found[f"{name}_token_id"] = source[f"{name}_token_id"]
    missing = [name for name in SPECIAL_TOKENS if f"{name}_token_id" not in found]
    if missing:
        config, ids = _json(base / "tokenizer_config.json"), _token_ids(base)
        for name in missing:
            token = _token_text(config.get(f"{name}_token"))
            if token is not None and token in ids:
                found[f"{name}_token_id"] = ids[token]
    return found


def _copy(source: Path, target: Path) -> None:
    write_atomically(target, lambda partial: shutil.copyfile(source, partial))


def _write_json(path: Path, content: dict[str, Any]) -> None:
    write_atomically(path, lambda partial: partial.write_text(json.dumps(content, indent=2, sort_keys=True) + "\n"))


def write_companions(out_dir: PathLike, base: PathLike) -> list[str]:
    """Copy the base's tokenizer files into the exported directory ``out_dir`` and write its
    ``generation_config.json`` (the base's, with the special token ids it lacks filled in; else one holding just
    them). Each file is replaced atomically. Returns the names written."""
    out, base = Path(out_dir), Path(base)
    written = []
    for file in tokenizer_files(base):
        _copy(file, out / file.name)
        written.append(file.name)
    ids = special_token_ids(base)
    generation = _json(base / GENERATION_CONFIG) or {"_from_model_config": True}
    for name, value in ids.items():
        if generation.get(name) is None:
            generation[name] = value
    if ids or (base / GENERATION_CONFIG).is_file():
        _write_json(out / GENERATION_CONFIG, generation)
        written.append(GENERATION_CONFIG)
    return written
