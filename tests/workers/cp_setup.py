"""The models and data of the context-parallel worker (``cp_layouts.py``) and of its single-process references."""

from dataclasses import replace

try:  # as a worker's import (tests/workers on the path) and as the tests' (tests on the path)
    import bert_setup
    import gpt_setup
except ImportError:
    from workers import bert_setup, gpt_setup

from lightning_megatron.models import BERT, GPT

# BERT without the sentence-order head (refused under context parallelism), masked-LM over padded samples.
BERT_CONFIG = replace(bert_setup.PRE_NORM, binary_head=False)
MODELS = {"gpt": lambda: GPT(gpt_setup.CONFIG), "llama": lambda: GPT(gpt_setup.LLAMA_CONFIG),
          "bert": lambda: BERT(BERT_CONFIG),
          # Packed samples with Megatron-LM's document masks (document ids, restarting positions, no loss on eos).
          "doc": lambda: GPT(gpt_setup.CONFIG), "llamadoc": lambda: GPT(gpt_setup.LLAMA_CONFIG),
          "chunk": lambda: GPT(gpt_setup.CHUNKED_CONFIG),
          # Sliding windows (and their rotary base, a softmax scale), alone and over packed documents.
          "window": lambda: GPT(gpt_setup.WINDOW_CONFIG), "windowdoc": lambda: GPT(gpt_setup.WINDOW_CONFIG),
          # Qwen3-shaped: per-head q/k norms, heads wider than hidden / heads.
          "qwen3": lambda: GPT(gpt_setup.QWEN3_CONFIG),
          # Gemma 3 whole: its windows, rotary bases and scale with the sandwich norms and the capped logits.
          "gemma3": lambda: GPT(gpt_setup.GEMMA3_CONFIG),
          # DeepSeek-V3's latent attention (values narrower than the heads) over packed documents.
          "mladoc": lambda: GPT(gpt_setup.MLA_CONFIG),
          # GPT-OSS's attention sinks (a logit per head, split with the heads over tp) with WINDOW_CONFIG's windows.
          "sinkwindow": lambda: GPT(replace(gpt_setup.WINDOW_CONFIG, attention_sinks=True))}
__all__ = ["BERT_CONFIG", "MODELS", "bert_setup", "gpt_setup", "model_batches", "model_loss"]


def model_batches(name: str) -> list[dict]:
    """The whole global batch of every step, as the model's training_step receives it."""
    if name == "bert":
        return [{key: batch[key] for key in ("input_ids", "labels", "attention_mask", "token_type_ids")}
                for batch in bert_setup.batches()]
    if name.endswith("doc"):
        return [{"input_ids": ids, "labels": labels, **side} for ids, labels, side in gpt_setup.document_batches()]
    return [{"input_ids": ids, "labels": labels} for ids, labels in gpt_setup.batches()]


def model_loss(root, batch: dict):
    """(loss sum, tokens) of the root model (GPTModel / BERTModel, or its pipeline runner) on one batch."""
    side = {key: value for key, value in batch.items() if key not in ("input_ids", "labels")}
    out = root.loss(batch["input_ids"], batch["labels"], **side)
    return (out.loss_sum, out.num_tokens) if hasattr(out, "loss_sum") else out


