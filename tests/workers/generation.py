"""Generation and full-vocabulary logits at several layouts over the same processes.

argv: OUT_DIR CHECKS, a comma list of ``<case>:<layout>`` (cases and layouts as in ``hf_parity.py``: ``gpt2`` or a
``hf_llama_setup.CASES`` name; ``tp2``, ``pp2``, ``tp2-pp2``, ``tp2-sp``, ...). Every rank builds the random
Hugging Face model from the shared seed and computes the oracles: ``transformers``' greedy ``generate`` and its
logits, and our own generation with sampling on the unsplit model in this process. Then it builds our model the way
the strategy does (meta device, plan, pipeline split with its inference path, this rank's weights) and generates.
Rank r writes ``rank{r}.json``: per check, whether greedy equals transformers, whether each sampling setting equals
the one-process tokens, the max |logit difference| of ``full_logits`` and the error ``F.cross_entropy`` raised on
the vocab-parallel logits (tp > 1 without pipelining).
"""

import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import hf_gpt2_setup
import hf_llama_setup
from hf_parity import bert_case, converted, parallel_config
from lightning_megatron.checkpoint.full import local_state_dict_from_full
from lightning_megatron.generation import full_logits, generate
from lightning_megatron.models import BERTModel, GPTModel
from lightning_megatron.models.gpt import gpt_tensor_parallel_plan
from lightning_megatron.parallel import ParallelState
from lightning_megatron.parallel.initialize import initialize_parameters
from lightning_megatron.strategy.options import StrategyOptions
from lightning_megatron.strategy.preparation import split_pipeline, start_pipeline
from lightning_megatron.tensor_parallel import full_sequences, gather_vocab_logits, parallelize
from entry import run_script

NEW_TOKENS = 12
SAMPLING = {"temperature": dict(temperature=0.8), "top_k+top_p": dict(temperature=0.9, top_k=20, top_p=0.8),
            "top_p": dict(temperature=1.2, top_p=0.7)}


def prompts():
    """Three prompts of lengths 7, 4 and 2, left-padded, as a transformers tokenizer with padding_side='left' gives."""
    ids = torch.randint(1, 300, (3, 7), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    mask[2, :5] = 0
    return ids.masked_fill(mask == 0, 0), mask


def case_of(name: str):
    hf = hf_gpt2_setup.build_hf_model() if name == "gpt2" else hf_llama_setup.build_hf_model(name)
    seed = hf_gpt2_setup.SEED if name == "gpt2" else hf_llama_setup.SEED
    case = converted(hf, seed=seed)
    ids, mask = prompts()
    with torch.no_grad():
        case.hf_greedy = hf.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        case.hf_logits = hf(ids).logits
    reference = GPTModel(case.config)
    reference.load_state_dict(case.full_state_dict)
    case.sampled = {name: generate(reference, ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, seed=3, **setting)
                    for name, setting in SAMPLING.items()}
    case.prompts = (ids, mask)
    return case


def build(state: ParallelState, case, model_class=GPTModel, plan=gpt_tensor_parallel_plan):
    with torch.device("meta"):
        model = model_class(case.config)
    parallelize(model, plan(case.config), state)
    split = split_pipeline(model, state)
    initialize_parameters(model, case.seed, device="cpu", only_meta=True)
    model.load_state_dict(local_state_dict_from_full(model, case.full_state_dict))
    if split is not None:
        start_pipeline(split, state, StrategyOptions(), device=torch.device("cpu"), recorder=None,
                       before_backward=lambda *args: None)
    return model


def check(state: ParallelState, case) -> dict:
    model = build(state, case)
    ids, mask = case.prompts
    greedy = generate(model, ids, attention_mask=mask, max_new_tokens=NEW_TOKENS)
    result = {"greedy_equals_hf": torch.equal(greedy, case.hf_greedy),
              "greedy_mismatches": int((greedy != case.hf_greedy).sum()) if greedy.shape == case.hf_greedy.shape else -1,
              "sampled_equal": {name: torch.equal(generate(model, ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                                                           seed=3, **setting), case.sampled[name])
                                for name, setting in SAMPLING.items()},
              "full_logits_max_abs_diff": (full_logits(model, ids) - case.hf_logits).abs().max().item(),
              "cross_entropy_error": None}
    if state.config.tensor_parallel_size > 1 and state.config.pipeline_parallel_size == 1:
        with full_sequences():  # 7 tokens do not split over tp under sequence parallelism
            logits = model(ids)
        try:
            F.cross_entropy(logits.flatten(0, 1), ids.flatten())
        except RuntimeError as error:
            result["cross_entropy_error"] = str(error)
        try:
            logits.float()[:, -1].argmax(dim=-1)  # casts and indexing keep the mark
        except RuntimeError as error:
            result["argmax_error"] = str(error)
        # The documented way for a predict_step of one's own.
        result["gathered_max_abs_diff"] = (gather_vocab_logits(logits) - case.hf_logits).abs().max().item()
    return result


def check_bert(state: ParallelState, case) -> dict:
    """BERT's predict path: full masked-LM logits (with padding and segments) against Hugging Face's."""
    model = build(state, case, BERTModel, BERTModel.tensor_parallel_plan)
    logits = full_logits(model, case.input_ids, head="mlm_head.decoder", **case.side)
    return {"full_logits_max_abs_diff": (logits - case.expected[0]).abs().max().item()}


def main(out_dir: Path, args: list[str]) -> None:
    checks = args[0].split(",")
    cases, states, results = {}, {}, {}
    for item in checks:
        name, layout = item.split(":")
        if name not in cases:
            cases[name] = bert_case() if name == "bert" else case_of(name)
        if layout not in states:
            states[layout] = ParallelState.create(parallel_config(layout, dist.get_world_size()), "cpu")
        results[item] = (check_bert if name == "bert" else check)(states[layout], cases[name])
    (out_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.barrier()


if __name__ == "__main__":
    run_script(main)
