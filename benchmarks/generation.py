"""Generation speed: our ``generate`` (key/value cache) against ``transformers``' ``generate`` on the same model.

Both run greedy decoding on the same randomly initialised weights in this one process (CPU unless a GPU is
present), the same prompts and the same number of new tokens, and must produce the same tokens (the table says
whether they did). For each model shape and batch size it prints new tokens per second of each side, their ratio
(ours / transformers, above 1 means faster), and ours without the cache (every step recomputes the whole
sequence: what the cache saves; timed once, at the first batch size only). Timings are the median of ``--repeats``
rounds after a warm-up round, the two sides taking turns in every round.

Example::

    python -m benchmarks.generation                       # GPT-2 124M-shaped and Llama-shaped models, batch 1 and 8
    python -m benchmarks.generation --quick               # tiny models, seconds
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lightning_megatron.generation import generate
from lightning_megatron.models import GPT


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-length", type=int, default=32)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--quick", action="store_true", help="tiny models, few tokens")
    return parser.parse_args(argv)


def hf_models(quick: bool):
    import transformers

    if quick:
        gpt2 = dict(n_embd=64, n_head=4, n_layer=2, vocab_size=512, n_positions=256)
        llama = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                     num_hidden_layers=2, vocab_size=512, max_position_embeddings=256)
    else:  # GPT-2 small's shape; a Llama-shaped model of similar size with grouped-query attention
        gpt2 = dict(n_embd=768, n_head=12, n_layer=12, vocab_size=50257, n_positions=1024)
        llama = dict(hidden_size=768, num_attention_heads=12, num_key_value_heads=4, intermediate_size=2048,
                     num_hidden_layers=12, vocab_size=32000, max_position_embeddings=1024)
    common = dict(bos_token_id=None, eos_token_id=None)
    yield "gpt2", transformers.GPT2LMHeadModel(transformers.GPT2Config(**gpt2, **common))
    yield "llama", transformers.LlamaForCausalLM(transformers.LlamaConfig(**llama, **common))


def timed_side_by_side(functions: dict, repeats: int) -> tuple[dict[str, float], dict[str, object]]:
    """Median seconds of each function over ``repeats`` rounds after a warm-up round; the functions take turns in
    every round, so a machine that slows down or speeds up meanwhile affects both sides alike."""
    results = {name: function() for name, function in functions.items()}  # warm-up
    times: dict[str, list[float]] = {name: [] for name in functions}
    for _ in range(repeats):
        for name, function in functions.items():
            start = time.perf_counter()
            results[name] = function()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}, results


def without_cache(model, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy decoding that recomputes the whole sequence every step (the baseline the cache improves on)."""
    with torch.no_grad():
        for _ in range(new_tokens):
            logits = model(ids)
            ids = torch.cat([ids, logits[:, -1].argmax(dim=-1, keepdim=True)], dim=1)
    return ids


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    new_tokens = 8 if args.quick else args.new_tokens
    prompt_length = 8 if args.quick else args.prompt_length
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"device {device}, {torch.get_num_threads()} threads, prompt {prompt_length} tokens, {new_tokens} new tokens, "
          f"greedy, median of {args.repeats}")
    header = ["model", "batch", "transformers tok/s", "ours tok/s", "ratio", "ours no cache tok/s", "same tokens"]
    print(" | ".join(header))
    print(" | ".join("---" for _ in header))
    for name, hf in hf_models(args.quick):
        hf = hf.to(device).eval()
        ours = GPT.from_hf(hf).model.to(device).eval()
        vocab = hf.config.vocab_size
        for batch in args.batch_sizes:
            ids = torch.randint(0, vocab, (batch, prompt_length), generator=torch.Generator().manual_seed(0)).to(device)
            mask = torch.ones_like(ids)
            seconds, tokens = timed_side_by_side({
                "hf": lambda: hf.generate(ids, attention_mask=mask, max_new_tokens=new_tokens,
                                          min_new_tokens=new_tokens, do_sample=False, pad_token_id=0),
                "ours": lambda: generate(ours, ids, max_new_tokens=new_tokens)}, args.repeats)
            hf_seconds, our_seconds = seconds["hf"], seconds["ours"]
            hf_tokens, our_tokens = tokens["hf"], tokens["ours"]
            produced = batch * new_tokens
            no_cache = "-"
            if batch == args.batch_sizes[0]:
                start = time.perf_counter()
                without_cache(ours, ids, new_tokens)
                no_cache = f"{produced / (time.perf_counter() - start):,.1f}"
            print(" | ".join([name, str(batch), f"{produced / hf_seconds:,.1f}", f"{produced / our_seconds:,.1f}",
                              f"{hf_seconds / our_seconds:.2f}", no_cache,
                              "yes" if torch.equal(hf_tokens, our_tokens) else "NO"]), flush=True)


if __name__ == "__main__":
    main()
