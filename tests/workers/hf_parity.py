"""Hugging Face GPT-2 or BERT outputs vs our converted model at several layouts over the same processes (2 ranks).

argv: OUT_DIR LAYOUTS, a comma list of ``tp2``, ``tp2-sp``, ``pp2``, each optionally prefixed by
``bert-`` (BERT; else GPT-2). Every rank builds the random HF model from the shared seed and
computes its outputs (the oracle: GPT-2's logits; BERT's masked-LM and sentence-order logits,
with padding), converts its state dict, builds our model the way the strategy does (meta
device, tensor-parallel plan, pipeline split, materialise) and loads this rank's part of the
converted weights. Each rank writes ``rank{r}.json``: per layout, the max |output difference|
where this rank holds the outputs (else null), and whether gathering the weights back and
converting them to HF gives the HF state dict bit for bit.
"""

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

import hf_bert_setup
import hf_gpt2_setup
from lightning_megatron.checkpoint.full import gather_full_state_dict, local_state_dict_from_full, merge_pipeline_stages
from lightning_megatron.checkpoint.hf import gpt_config_from_hf, gpt_state_dict_from_hf, hf_state_dict_from_gpt
from lightning_megatron.checkpoint.hf_bert import bert_config_from_hf, bert_state_dict_from_hf, hf_state_dict_from_bert
from lightning_megatron.models import BERTModel, GPTModel
from lightning_megatron.parallel import ParallelConfig, ParallelState
from lightning_megatron.parallel.initialize import initialize_parameters
from lightning_megatron.pipeline import PipelineLayout
from lightning_megatron.pipeline.stage import split_for_pipeline
from lightning_megatron.tensor_parallel import parallelize
from lightning_megatron.tensor_parallel.mappings import gather_from_tensor_parallel

LAYOUTS = {
    "tp2": ParallelConfig(tensor_parallel_size=2),
    "tp2-sp": ParallelConfig(tensor_parallel_size=2, sequence_parallel=True),
    "pp2": ParallelConfig(pipeline_parallel_size=2),
}


def gpt2_case():
    hf = hf_gpt2_setup.build_hf_model()
    input_ids = hf_gpt2_setup.sample_input_ids()
    with torch.no_grad():
        expected = [hf(input_ids).logits]
    config = gpt_config_from_hf(hf.config)
    return SimpleNamespace(model_class=GPTModel, plan=GPTModel.tensor_parallel_plan(), config=config, hf_state_dict=hf.state_dict(),
                           full_state_dict=gpt_state_dict_from_hf(hf.state_dict(), config), to_hf=hf_state_dict_from_gpt,
                           input_ids=input_ids, side={}, expected=expected, seed=hf_gpt2_setup.SEED)


def bert_case():
    hf = hf_bert_setup.build_hf_model()
    inputs = hf_bert_setup.sample_inputs()
    with torch.no_grad():
        out = hf(**inputs)
    config = bert_config_from_hf(hf.config)
    side = {name: value for name, value in inputs.items() if name != "input_ids"}
    return SimpleNamespace(model_class=BERTModel, plan=BERTModel.tensor_parallel_plan(config), config=config,
                           hf_state_dict=hf.state_dict(), full_state_dict=bert_state_dict_from_hf(hf.state_dict(), config),
                           to_hf=hf_state_dict_from_bert, input_ids=inputs["input_ids"], side=side,
                           expected=[out.prediction_logits, out.seq_relationship_logits], seed=hf_bert_setup.SEED)


def build(state: ParallelState, case):
    """Our model as the strategy builds it, holding this rank's part of the converted weights; and its pipeline stage."""
    with torch.device("meta"):
        model = case.model_class(case.config)
    parallelize(model, case.plan, state)
    stage = None
    pp = state.config.pipeline_parallel_size
    if pp > 1:
        layout = PipelineLayout(num_layers=case.config.num_layers, pipeline_parallel_size=pp)
        (stage,) = split_for_pipeline(model, case.model_class.pipeline_blocks(), layout.stage_layers(),
                                      layout.stages_of_rank(state.pipeline_parallel_rank))
    initialize_parameters(model, case.seed, device="cpu", only_meta=True)
    model.load_state_dict(local_state_dict_from_full(model, case.full_state_dict))
    return model.eval(), stage


def pipeline_outputs(state: ParallelState, stage, case):
    """Two stages by hand: the first sends its hidden state to the second, which returns the head's outputs."""
    group = state.pipeline_parallel_group
    rank = state.pipeline_parallel_rank
    peer = dist.get_global_rank(group, 1 - rank)
    if rank == 0:
        dist.send(stage(case.input_ids, **case.side).contiguous(), dst=peer)
        return None
    hidden = torch.empty(*case.input_ids.shape, case.config.hidden_size)
    dist.recv(hidden, src=peer)
    return stage(hidden, **case.side)


def as_list(outputs) -> list:
    """GPT: the logits; BERT: masked-LM and sentence-order logits (its head also passes the labels through)."""
    return [outputs] if isinstance(outputs, torch.Tensor) else list(outputs[:2])


def check(layout: str, case) -> dict:
    state = ParallelState.create(LAYOUTS[layout], "cpu")
    model, stage = build(state, case)
    with torch.no_grad():
        if stage is None:
            outputs = as_list(model(case.input_ids, **case.side))
            outputs[0] = gather_from_tensor_parallel(outputs[0], state.tensor_parallel_group)  # vocab-parallel logits
        else:
            outputs = pipeline_outputs(state, stage, case)
            outputs = None if outputs is None else as_list(outputs)
    deviation = None
    if outputs is not None:
        outputs[0] = outputs[0][..., : case.config.vocab_size]
        deviation = max((got - want).abs().max().item() for got, want in zip(outputs, case.expected, strict=True))
    gathered = merge_pipeline_stages(gather_full_state_dict(model, state.tensor_parallel_group),
                                     state.pipeline_parallel_group)
    back = case.to_hf(gathered, case.config)
    identical = back.keys() == case.hf_state_dict.keys() and all(torch.equal(back[k], v) for k, v in case.hf_state_dict.items())
    return {"max_abs_diff": deviation, "round_trip_identical": identical}


if __name__ == "__main__":
    out_dir, layouts = Path(sys.argv[1]), sys.argv[2].split(",")
    dist.init_process_group("gloo")
    cases, results = {}, {}
    for layout in layouts:
        family, parallel = ("bert", layout.removeprefix("bert-")) if layout.startswith("bert-") else ("gpt2", layout)
        if family not in cases:
            cases[family] = bert_case() if family == "bert" else gpt2_case()
        results[layout] = check(parallel, cases[family])
    (out_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.barrier()
    os._exit(0)  # skip gloo's C++ teardown: with several meshes alive it aborts at random (torch 2.13)
