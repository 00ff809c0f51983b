"""``lightning-megatron generate``: continue prompts with a trained GPT, in one process.

::

    lightning-megatron generate --checkpoint runs/checkpoints/last.ckpt --prompt "def fib(n):" --max-new-tokens 64
    lightning-megatron generate --checkpoint hf_llama_dir/ --prompt "The capital of France" --temperature 0.8 --top-p 0.95
    lightning-megatron generate --checkpoint runs/sft/last.ckpt --prompt "Reverse cat." --prompt-style plain
    lightning-megatron generate --checkpoint hf_chat_dir/ --prompt "Hello!" --prompt-style chat

The checkpoint is a sharded checkpoint directory (any saving layout), a ``checkpoint_format="full"`` file, or a
Hugging Face ``save_pretrained`` directory. The tokenizer: ``--tokenizer`` (``byte`` or a ``tokenizer.json``), else
the Hugging Face directory's ``tokenizer.json``, else the byte tokenizer when the model's vocabulary is the byte
vocabulary (the default data's). ``--prompt-style`` asks a fine-tuned model in the format it was taught: each prompt
becomes a user turn written as ``SFTDataModule`` writes conversations (a built-in style such as ``plain``, or ``chat``:
the chat template of the Hugging Face tokenizer directory, ``--tokenizer DIR`` or the checkpoint's own). Each
continuation is printed after its prompt; timings go to stderr.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import torch

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


def choose_tokenizer(spec: Optional[str], checkpoint: Path, vocab_size: int) -> Tokenizer:
    if spec is not None:
        return load_tokenizer(spec)
    if (checkpoint / "tokenizer.json").is_file():
        return load_tokenizer(checkpoint / "tokenizer.json")
    byte = load_tokenizer("byte")
    if vocab_size == byte.vocab_size:
        return byte
    raise ValueError(f"The model's vocabulary has {vocab_size} tokens, not the byte tokenizer's "
                     f"{byte.vocab_size}, and {checkpoint} holds no tokenizer.json: pass --tokenizer "
                     f"with the tokenizer.json the model was trained with.")


def encode_prompts(prompts: Sequence[str], tokenizer: Tokenizer, *, prompt_style: Optional[str],
                   tokenizer_spec: Optional[str], checkpoint: Path) -> tuple[Tokenizer, list[list[int]]]:
    """The prompts' ids: as they are, or each as a user turn in ``prompt_style`` (``"chat"``: the Hugging Face
    tokenizer directory's chat template, which then is also the tokenizer)."""
    if prompt_style is None:
        return tokenizer, [tokenizer.encode(prompt) for prompt in prompts]
    if prompt_style == "chat":
        directory = Path(tokenizer_spec) if tokenizer_spec is not None else checkpoint
        if not (directory.is_dir() and (directory / "tokenizer_config.json").is_file()):
            raise ValueError(f"--prompt-style chat writes prompts with a Hugging Face tokenizer's chat template, but "
                             f"{directory} is no tokenizer directory: pass --tokenizer DIR (the directory holding "
                             f"tokenizer_config.json).")
        tokenizer = load_sft_tokenizer(str(directory))
        style = None
    else:
        style = prompt_style
    chat = conversation_format(tokenizer, tokenizer_spec or "byte", style)
    return tokenizer, [chat.prompt([Message("user", prompt)]) for prompt in prompts]


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="lightning-megatron generate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="checkpoint directory or file, or a Hugging Face directory")
    parser.add_argument("--prompt", action="append", required=True, help="text to continue (repeat for a batch)")
    parser.add_argument("--tokenizer", help="'byte' or a tokenizer.json (default: see above)")
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
        tokenizer = choose_tokenizer(args.tokenizer, Path(args.checkpoint), gpt.config.vocab_size)
        tokenizer, prompts = encode_prompts(args.prompt, tokenizer, prompt_style=args.prompt_style,
                                            tokenizer_spec=args.tokenizer, checkpoint=Path(args.checkpoint))
        eos_id = None if args.no_eos else tokenizer.eos_id
        start = time.perf_counter()
        outputs = gpt.generate(prompts, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                               top_k=args.top_k, top_p=args.top_p, eos_id=eos_id, seed=args.seed)
    except (FileNotFoundError, ValueError) as error:  # what the user can fix: said as the last line, no traceback
        parser.error(str(error))
    seconds = time.perf_counter() - start
    new_tokens = sum(len(out) - len(prompt) for out, prompt in zip(outputs, prompts))
    for prompt_text, prompt, out in zip(args.prompt, prompts, outputs):
        separator = "" if args.prompt_style is None else "\n"  # a response, not a continuation of the text
        print(prompt_text + separator + tokenizer.decode(out[len(prompt):]))
        print("-" * 40)
    print(f"{new_tokens} new tokens in {seconds:.2f} s ({new_tokens / seconds:.1f} tokens/s, {len(prompts)} prompts, "
          f"{args.device})", file=sys.stderr)
