"""Text generation with a key/value cache at any layout, and full-vocabulary logits for prediction.

:func:`generate` runs the prompt once (prefill), then one token per step, each step feeding only the
new token and reading earlier keys and values from a :class:`KVCache`. It works on a plain decoder
in one process and on one split by ``Megatron3DStrategy``:

* tensor parallelism: the logits stay split over the vocabulary and the sampler reduces over the group
  (``sampling.py``); sequence parallelism is suspended (``full_sequences``), so one token per step works;
* pipeline parallelism: the stages run one after another (``pipeline/inference.py``), the last samples
  and broadcasts the token to the other stages, which feed it to the first on the next step.

The tokens depend on the seed, the prompt and the weights only: every layout generates the same.

The decoder protocol (``GPTModel``'s): ``forward(input_ids, position_ids=, kv_cache=, logits_to_keep=)``,
an ``lm_head`` and ``config.max_seq_length``; a pipeline-split model carries ``pipeline_inference``.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_megatron.generation.kv_cache import KVCache
from lightning_megatron.generation.sampling import SamplingSettings, VocabParallelSampler
from lightning_megatron.tensor_parallel.logits import VocabShard, gather_vocab_logits
from lightning_megatron.tensor_parallel.mappings import full_sequences

Prompts = Union[Tensor, Sequence[Sequence[int]]]


def _all_finished(model: nn.Module, finished: Tensor) -> bool:
    """Whether every sequence has ended, here and, under expert parallelism, on every rank this one exchanges
    tokens with: they stop together, or the next step's all-to-alls would wait for ranks that stopped."""
    done = finished.all()
    group = getattr(model, "expert_parallel_group", None)  # set by expert_parallel.apply_expert_parallel
    if group is not None:
        done = done.to(torch.int32)
        dist.all_reduce(done, op=dist.ReduceOp.MIN, group=group)
    return bool(done)


@torch.no_grad()
def generate(
    model: nn.Module,
    input_ids: Prompts,
    *,
    max_new_tokens: int = 32,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_id: Optional[int] = None,
    seed: int = 0,
    attention_mask: Optional[Tensor] = None,
    pad_id: Optional[int] = None,
) -> Union[Tensor, list[list[int]]]:
    """Continue each prompt by up to ``max_new_tokens`` tokens; greedy unless ``temperature > 0``.

    ``input_ids``: a ``[B, S]`` tensor (left-padded, with ``attention_mask`` 0 at padding, as a
    ``transformers`` tokenizer gives with ``padding_side="left"``), or a list of token lists of any lengths.
    Returns what ``transformers``' ``generate`` does for a tensor: the prompts followed by the new tokens,
    ``[B, S + n]``, with ``pad_id`` (default ``eos_id``) after a sequence's ``eos_id``; generation stops
    early once every sequence has ended. For a list: each prompt's tokens and its new ones, up to and
    including its ``eos_id``.

    Example::

        model = GPT.from_hf("gpt2_dir").model
        tokens = generate(model, [[464, 2068], [15496]], max_new_tokens=20, temperature=0.8, top_p=0.95, seed=1)
    """
    settings = SamplingSettings(temperature=temperature, top_k=top_k, top_p=top_p)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1.")
    device = next(model.parameters()).device
    as_lists = not isinstance(input_ids, Tensor)
    fill = pad_id if pad_id is not None else (eos_id if eos_id is not None else 0)
    if as_lists:
        input_ids, attention_mask = left_pad(input_ids, fill)
    input_ids = input_ids.to(device)
    valid = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.to(device).bool()
    batch, prompt = input_ids.shape
    limit = model.config.max_seq_length
    if prompt + max_new_tokens > limit:
        raise ValueError(f"A prompt of {prompt} tokens plus max_new_tokens={max_new_tokens} exceeds the model's "
                         f"max_seq_length={limit}: shorten the prompt or ask for at most {limit - prompt} new tokens.")
    if not bool(valid[:, -1].all()):
        raise ValueError("Prompts must be left-padded (the last position of every row a real token): pad on the "
                         "left, as a transformers tokenizer does with padding_side='left', or pass lists of ids.")

    pipeline = getattr(model, "pipeline_inference", None)
    samples = pipeline is None or pipeline.is_last
    sampler = VocabParallelSampler(settings, VocabShard.of_head(model.lm_head), seed=seed) if samples else None
    cache = KVCache(batch, prompt + max_new_tokens, device=device)
    positions = (valid.long().cumsum(dim=1) - 1).clamp(min=0)
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    pieces = [input_ids]
    step_ids, step_valid = input_ids, valid
    with _evaluating(model), full_sequences():
        for _ in range(max_new_tokens):
            cache.start(step_valid)
            side = dict(position_ids=positions, kv_cache=cache, logits_to_keep=1)
            logits = pipeline(step_ids, **side) if pipeline is not None else model(step_ids, **side)
            cache.advance()
            token = sampler(logits[:, -1]) if samples else None
            if pipeline is not None:
                token = pipeline.broadcast_from_last(token)
            if eos_id is not None:
                token = token.masked_fill(finished, fill)
                finished |= token == eos_id
            pieces.append(token[:, None])
            if eos_id is not None and _all_finished(model, finished):
                break
            step_ids, step_valid = token[:, None], torch.ones(batch, 1, dtype=torch.bool, device=device)
            positions = positions[:, -1:] + 1
    tokens = torch.cat(pieces, dim=1)
    return _as_lists(tokens, valid, eos_id) if as_lists else tokens


@torch.no_grad()
def full_logits(model: nn.Module, input_ids: Tensor, *, head: str = "lm_head", **side: Tensor) -> Tensor:
    """fp32 logits over the whole, unpadded vocabulary ``[B, S, V]`` on every rank, at any layout.

    For prediction: under tensor parallelism they are gathered over the group, under pipeline parallelism
    broadcast from the last stage (``B * S * V`` floats: mind the size at a large vocabulary). ``head``: the
    name of the output layer whose logits these are (it lives on the last pipeline stage only); a model whose
    forward returns several outputs (BERT's) gives its logits first.
    """
    pipeline = getattr(model, "pipeline_inference", None)
    with _evaluating(model), full_sequences():
        output = pipeline(input_ids, **side) if pipeline is not None else model(input_ids, **side)
        full = None
        if pipeline is None or pipeline.is_last:
            logits = output if isinstance(output, Tensor) else output[0]
            full = gather_vocab_logits(logits, model.get_submodule(head)).float()
        if pipeline is not None:
            full = pipeline.broadcast_from_last(full)
    return full


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Token lists of any lengths as a left-padded ``[B, S]`` tensor and its attention mask."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("Every prompt needs at least one token (got an empty list or an empty prompt).")
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.as_tensor(list(prompt), dtype=torch.long)
        mask[row, width - len(prompt):] = 1
    return ids, mask


def _as_lists(tokens: Tensor, valid: Tensor, eos_id: Optional[int]) -> list[list[int]]:
    prompt = valid.shape[1]
    tokens, valid = tokens.cpu(), valid.cpu()
    out = []
    for row in range(tokens.shape[0]):
        new = tokens[row, prompt:].tolist()
        if eos_id is not None and eos_id in new:
            new = new[: new.index(eos_id) + 1]
        out.append(tokens[row, :prompt][valid[row].cpu()].tolist() + new)
    return out


@contextlib.contextmanager
def _evaluating(model: nn.Module) -> Iterator[None]:
    """Dropout off while generating; each module's mode restored afterwards."""
    modes = {module: module.training for module in model.modules()}
    model.eval()
    try:
        yield
    finally:
        for module, training in modes.items():
            module.train(training)
