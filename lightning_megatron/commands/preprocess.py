"""``lightning-megatron preprocess``, ``document-ends`` and ``train-tokenizer``: the command lines over
:mod:`lightning_megatron.data.preprocess` (what is read, how, and what is written: see there).

Example::

    lightning-megatron preprocess --input corpus.jsonl --tokenizer byte --output-prefix data/corpus --workers 4
    lightning-megatron preprocess --input books/ extra.txt --tokenizer byte --output-prefix data/all
    lightning-megatron preprocess --input wiki/ --split train --tokenizer bert.json --split-sentences \\
        --output-prefix data/wiki
    lightning-megatron document-ends data/megatron_made_text_document
    lightning-megatron train-tokenizer --input corpus.jsonl --vocab-size 8000 --output tokenizer.json
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from lightning_megatron.data.preprocess import preprocess, training_texts, write_document_ends_of
from lightning_megatron.data.readers import input_files
from lightning_megatron.data.tokenizers import train_bpe_tokenizer, train_wordpiece_tokenizer


def expand_inputs(parser: argparse.ArgumentParser, inputs: Sequence[str]) -> list[Path]:
    """The files the command's ``--input`` names (:func:`~lightning_megatron.data.readers.input_files`); an input
    that is missing or a folder without documents ends the command with its message; files a folder holds of
    another kind are named on stderr."""
    try:
        files, left_out = input_files(inputs)
    except (FileNotFoundError, ValueError) as error:
        parser.error(str(error))
    if left_out:
        shown = ", ".join(str(path) for path in left_out[:3]) + (", ..." if len(left_out) > 3 else "")
        print(f"{parser.prog}: not read (neither .jsonl, .txt nor .parquet): {len(left_out)} files ({shown})",
              file=sys.stderr)
    return files


INPUT_HELP = ("a .jsonl (one JSON object per line), .txt (one document per line) or .parquet file (one document "
              "per row), a directory written by Hugging Face datasets' save_to_disk, or a folder: its .jsonl, .txt "
              "and .parquet files, sub-folders included, in sorted path order. Several inputs (--input a b, or "
              "--input a --input b) are read in the order given, into one dataset")
JSON_KEY_HELP = "the key (.jsonl) or column (.parquet, datasets) holding a document's text"
SPLIT_HELP = "the split to read from a Hugging Face DatasetDict directory"


def main(argv: Sequence[str] | None = None) -> None:
    """``lightning-megatron preprocess``: see :mod:`lightning_megatron.data.preprocess`."""
    parser = argparse.ArgumentParser(
        prog="lightning-megatron preprocess",
        description="Tokenise .jsonl, .txt and .parquet files, folders of them and Hugging Face datasets directories "
        "into one Megatron-LM indexed dataset PREFIX.bin/PREFIX.idx plus PREFIX.ends and PREFIX.meta.json.",
    )
    parser.add_argument("--input", required=True, action="extend", nargs="+", metavar="INPUT", help=INPUT_HELP)
    parser.add_argument("--tokenizer", required=True, help="'byte' or the path of a Hugging Face tokenizer.json")
    parser.add_argument("--output-prefix", required=True,
                        help="writes PREFIX.bin, PREFIX.idx, PREFIX.ends, PREFIX.meta.json")
    parser.add_argument("--json-key", default="text", help=JSON_KEY_HELP)
    parser.add_argument("--split", help=SPLIT_HELP)
    parser.add_argument("--workers", type=int, default=1, help="tokenising processes, one core each")
    parser.add_argument("--on-error", choices=("skip", "stop"), default="stop",
                        help="on a malformed record: stop with an error (default), or skip it and count it")
    parser.add_argument("--append-eos", action="store_true",
                        help="end each document with the end-of-document id ([SEP] for a WordPiece tokenizer)")
    parser.add_argument("--split-sentences", action="store_true",
                        help="store each sentence of a document as a sequence of its own (BERT's segments)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    result = preprocess(input=expand_inputs(parser, args.input), tokenizer=args.tokenizer,
                        output_prefix=args.output_prefix,
                        json_key=args.json_key, workers=args.workers, on_error=args.on_error,
                        append_eos=args.append_eos, split_sentences=args.split_sentences, split=args.split,
                        progress=not args.no_progress)
    skipped = f", {result.skipped_lines} malformed {result.record_name}s skipped" if result.skipped_lines else ""
    print(f"{args.output_prefix}: {result.documents} documents, {result.tokens} tokens in {result.seconds:.1f} s "
          f"({result.tokens_per_second:,.0f} tokens/s, {args.workers} workers){skipped}")


def document_ends_main(argv: Sequence[str] | None = None) -> None:
    """``lightning-megatron document-ends PREFIX...``: see :func:`write_document_ends_of`."""
    parser = argparse.ArgumentParser(
        prog="lightning-megatron document-ends",
        description="Record each document's last token of existing Megatron-LM .bin/.idx datasets (e.g. made by "
        "Megatron-LM's preprocess_data.py) in PREFIX.ends, so that GPT index builds read only the .idx and not the "
        ".bin. The .bin/.idx are not changed and an existing PREFIX.ends is not replaced.",
    )
    parser.add_argument("prefixes", nargs="+", metavar="PREFIX", help="a dataset's PREFIX.bin/PREFIX.idx, without "
                        "the suffix")
    for prefix in parser.parse_args(argv).prefixes:
        print(write_document_ends_of(prefix))


def train_tokenizer_main(argv: Sequence[str] | None = None) -> None:
    """``lightning-megatron train-tokenizer``: a byte-level BPE or a BERT WordPiece ``tokenizer.json`` from inputs
    read as ``preprocess`` reads them."""
    parser = argparse.ArgumentParser(
        prog="lightning-megatron train-tokenizer",
        description="Train a byte-level BPE tokenizer (with an <|endoftext|> token; for GPT) or a WordPiece one "
        "(with [PAD] [UNK] [CLS] [SEP] [MASK]; for BERT) on .jsonl/.txt/.parquet files or datasets directories, "
        "offline.",
    )
    parser.add_argument("--input", required=True, action="extend", nargs="+", metavar="INPUT",
                        help="inputs read as by preprocess: " + INPUT_HELP)
    parser.add_argument("--vocab-size", type=int, required=True, help="ids in the vocabulary, special tokens included")
    parser.add_argument("--output", required=True, help="the tokenizer.json to write")
    parser.add_argument("--model", choices=("bpe", "wordpiece"), default="bpe",
                        help="byte-level BPE (GPT-2's kind, the default) or WordPiece (BERT's)")
    parser.add_argument("--lowercase", action="store_true",
                        help="WordPiece only: lowercase and strip accents first (an uncased vocabulary)")
    parser.add_argument("--json-key", default="text", help=JSON_KEY_HELP)
    parser.add_argument("--split", help=SPLIT_HELP)
    parser.add_argument("--on-error", choices=("skip", "stop"), default="stop", help="on a malformed record")
    args = parser.parse_args(argv)
    if args.lowercase and args.model != "wordpiece":
        parser.error("--lowercase applies to --model wordpiece; a byte-level BPE keeps the text as it is.")
    texts = training_texts(expand_inputs(parser, args.input), json_key=args.json_key, split=args.split,
                           on_error=args.on_error, output=args.output)
    if args.model == "wordpiece":
        tokenizer = train_wordpiece_tokenizer(texts, vocab_size=args.vocab_size, output_path=args.output,
                                              lowercase=args.lowercase)
        specials = f"{tokenizer.pad_id} {tokenizer.cls_id} {tokenizer.sep_id} {tokenizer.mask_id}"
        print(f"{args.output}: WordPiece{' (lowercased)' if args.lowercase else ''}, {tokenizer.vocab_size} ids, "
              f"[PAD] [CLS] [SEP] [MASK] = {specials}, end of document [SEP]")
        return
    tokenizer = train_bpe_tokenizer(texts, vocab_size=args.vocab_size, output_path=args.output)
    print(f"{args.output}: byte-level BPE, {tokenizer.vocab_size} ids, end of document {tokenizer.eos_token!r} "
          f"= {tokenizer.eos_id}")
