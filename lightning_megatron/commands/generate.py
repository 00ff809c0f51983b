"""``lightning-megatron generate``: continue prompts with a trained GPT, in one process.

::

    lightning-megatron generate --checkpoint runs/checkpoints/last.ckpt --prompt "def fib(n):" --max-new-tokens 64
    lightning-megatron generate --checkpoint hf_llama_dir/ --prompt "The capital of France" --temperature 0.8 --top-p 0.95
    lightning-megatron generate --checkpoint runs/sft/last.ckpt --prompt "Reverse cat." --prompt-style plain
    lightning-megatron generate --checkpoint hf_chat_dir/ --prompt "Hello!" --prompt-style chat

The checkpoint is a sharded checkpoint directory (any saving layout), a ``checkpoint_format="full"`` file, or a
Hugging Face ``save_pretrained`` directory. The tokenizer: ``--tokenizer`` (``byte``, a Hugging Face tokenizer
directory or a ``tokenizer.json``), else the model's own: the Hugging Face directory's, or for a training checkpoint
that of the base it records (``pretrained``: the directory a fine-tune started from), else the byte tokenizer when
the model's vocabulary is the byte vocabulary (the default data's). ``--prompt-style`` asks a fine-tuned model in the
format it was taught: each prompt becomes a user turn written as ``SFTDataModule`` writes conversations (a built-in
style such as ``plain``, or ``chat``: the chat template of that Hugging Face tokenizer directory; a ``tokenizer.json``
given for it stands for the directory it lies in). Each continuation is printed after its prompt; timings go to
stderr.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import torch

from lightning_megatron.checkpoint.open import open_checkpoint, recorded_base
from lightning_megatron.data.conversations import Message
from lightning_megatron.data.sft import conversation_format, load_sft_tokenizer
from lightning_megatron.data.tokenizers import Tokenizer, load_tokenizer
from lightning_megatron.models.gpt import GPT


def load_gpt(path: str | Path) -> GPT:
    """A GPT in one process from a sharded checkpoint directory, a full checkpoint file or a Hugging Face directory."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"No checkpoint at {path}: give a checkpoint directory or file, or a Hugging Face "
                                f"model directory (with config.json).")
    if path.is_dir() and (path / "config.json").is_file():
        return GPT.from_hf(path)
    try:
        return GPT.load_from_checkpoint(path, map_location="cpu")
    except TypeError as error:  # the saved config has fields GPTConfig does not know: another model
        raise ValueError(f"{path} does not hold a GPT (its hyper-parameters do not build one: {error}); "
                         f"generation needs a decoder.") from error


def tokenizer_home(path: str | Path) -> Optional[Path]:
    """The Hugging Face directory whose tokenizer the model at ``path`` uses unless told otherwise: ``path`` itself
    (a Hugging Face directory), or the base its training checkpoint records (``pretrained``: the directory a
    fine-tune started from; an adapter-only checkpoint's base reference); None when it records none."""
    path = Path(path)
    if path.is_dir() and (path / "config.json").is_file():
        return path
    base = recorded_base(open_checkpoint(path).trainer_state())
    return None if base is None else Path(base)


def choose_tokenizer(spec: Optional[str], home: Optional[Path], vocab_size: int, *,
                     prompt_style: Optional[str] = None) -> Tokenizer:
    """The tokenizer of the prompts: ``spec`` (``--tokenizer``: ``byte``, a Hugging Face tokenizer directory or a
    ``tokenizer.json``), else ``home``'s tokenizer, else the byte tokenizer when the model's vocabulary is the byte
    vocabulary. ``prompt_style="chat"`` needs a Hugging Face tokenizer directory (its chat template): a
    ``tokenizer.json`` inside one stands for it. ``ValueError``/``FileNotFoundError`` name what to pass instead."""
    chat = prompt_style == "chat"
    home_files = {name for name in ("tokenizer_config.json", "tokenizer.json") if home and (home / name).is_file()}
    if spec is not None:
        tokenizer = tokenizer_at(spec, chat=chat, what=f"--tokenizer {spec}")
    elif "tokenizer_config.json" in home_files or (home_files and not chat):
        tokenizer = tokenizer_at(str(home), chat=chat, what=f"the tokenizer of {home}")
    elif chat:
        raise ValueError(f"--prompt-style chat writes prompts with a Hugging Face tokenizer's chat template, but "
                         f"{no_tokenizer(home, 'Hugging Face tokenizer (tokenizer_config.json)')}, so there is no "
                         f"tokenizer directory: pass --tokenizer DIR (the directory holding tokenizer_config.json), or "
                         f"--prompt-style plain.")
    else:
        tokenizer = load_tokenizer("byte")
        if vocab_size != tokenizer.vocab_size:
            raise ValueError(f"The model's vocabulary has {vocab_size} tokens, not the byte tokenizer's "
                             f"{tokenizer.vocab_size}, and "
                             f"{no_tokenizer(home, 'tokenizer (tokenizer_config.json or tokenizer.json)')}: pass "
                             f"--tokenizer with the tokenizer the model was trained with (a Hugging Face tokenizer "
                             f"directory or its tokenizer.json).")
    if tokenizer.vocab_size > vocab_size:
        raise ValueError(f"The tokenizer ({spec or home}) has {tokenizer.vocab_size} tokens but the model's vocabulary "
                         f"only {vocab_size}: it is not the tokenizer this model was trained with; pass that one as "
                         f"--tokenizer.")
    return tokenizer


def no_tokenizer(home: Optional[Path], looked_for: str) -> str:
    """Why the model's own tokenizer cannot be had (``home`` as :func:`tokenizer_home` gives it)."""
    if home is None:
        return "the checkpoint records no Hugging Face base model (`pretrained`) to take a tokenizer from"
    if not home.is_dir():
        return (f"the base model {home} that the checkpoint records is not there (moved, or a path relative to where "
                f"the run started)")
    return f"the model's Hugging Face directory {home} holds no {looked_for}"


def tokenizer_at(spec: str, *, chat: bool, what: str) -> Tokenizer:
    """``byte``, a Hugging Face tokenizer directory (``tokenizer_config.json``: with its chat template), or a
    ``tokenizer.json`` file (for ``chat``: the directory it lies in, which must be a tokenizer directory)."""
    path = Path(spec)
    if spec == "byte":
        if chat:
            raise ValueError("--prompt-style chat needs a chat template, which the byte tokenizer has none of: use "
                             "--prompt-style plain, or pass a Hugging Face tokenizer directory as --tokenizer.")
        return load_tokenizer("byte")
    if not path.exists():
        raise FileNotFoundError(f"{what}: no such file or directory; give 'byte', a Hugging Face tokenizer directory "
                                f"(holding tokenizer_config.json) or a tokenizer.json file.")
    directory = path if path.is_dir() else path.parent
    if (directory / "tokenizer_config.json").is_file() and (chat or path.is_dir()):
        return load_sft_tokenizer(str(directory))
    if chat:
        raise ValueError(f"--prompt-style chat writes prompts with a Hugging Face tokenizer's chat template, but "
                         f"{what} is no tokenizer directory (no tokenizer_config.json{' beside it' if path.is_file() else ''}"
                         f"; a tokenizer.json alone holds no template): pass --tokenizer DIR (the directory holding "
                         f"tokenizer_config.json), or --prompt-style plain.")
    if path.is_dir():
        if not (path / "tokenizer.json").is_file():
            raise ValueError(f"{what}: the directory holds no tokenizer (tokenizer_config.json or tokenizer.json).")
        path = path / "tokenizer.json"
    return load_tokenizer(path)


def encode_prompts(prompts: Sequence[str], tokenizer: Tokenizer, prompt_style: Optional[str]) -> list[list[int]]:
    """The prompts' ids: as they are, or each as a user turn in ``prompt_style`` (``"chat"``: the tokenizer's chat
    template, with the generation prompt that starts the assistant's turn)."""
    if prompt_style is None:
        return [tokenizer.encode(prompt) for prompt in prompts]
    chat = conversation_format(tokenizer, str(getattr(tokenizer, "path", "byte")),
                               None if prompt_style == "chat" else prompt_style)
    return [chat.prompt([Message("user", prompt)]) for prompt in prompts]


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="lightning-megatron generate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="checkpoint directory or file, or a Hugging Face directory")
    parser.add_argument("--prompt", action="append", required=True, help="text to continue (repeat for a batch)")
    parser.add_argument("--tokenizer", help="'byte', a Hugging Face tokenizer directory or a tokenizer.json "
                                            "(default: the model's own, see above)")
    parser.add_argument("--prompt-style", help="write each prompt as a user turn, as a fine-tuned model was taught: "
                                               "a built-in style ('plain') or 'chat' (the tokenizer's chat template)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (the default) is greedy")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-eos", action="store_true", help="do not stop at the tokenizer's end-of-text token")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)

    try:
        gpt = load_gpt(args.checkpoint).to(args.device)
        tokenizer = choose_tokenizer(args.tokenizer, tokenizer_home(args.checkpoint), gpt.config.vocab_size,
                                     prompt_style=args.prompt_style)
        prompts = encode_prompts(args.prompt, tokenizer, args.prompt_style)
        eos_id = None if args.no_eos else tokenizer.eos_id
        start = time.perf_counter()
        outputs = gpt.generate(prompts, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                               top_k=args.top_k, top_p=args.top_p, eos_id=eos_id, seed=args.seed)
    except (FileNotFoundError, ImportError, ValueError) as error:  # what the user can fix: the last line, no traceback
        parser.error(str(error))
    seconds = time.perf_counter() - start
    new_tokens = sum(len(out) - len(prompt) for out, prompt in zip(outputs, prompts))
    for prompt_text, prompt, out in zip(args.prompt, prompts, outputs):
        separator = "" if args.prompt_style is None else "\n"  # a response, not a continuation of the text
        print(prompt_text + separator + tokenizer.decode(out[len(prompt):]))
        print("-" * 40)
    print(f"{new_tokens} new tokens in {seconds:.2f} s ({new_tokens / seconds:.1f} tokens/s, {len(prompts)} prompts, "
          f"{args.device})", file=sys.stderr)
