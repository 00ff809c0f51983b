"""Layer-level checks of the tensor-parallel layers against the plain PyTorch ops (2 ranks).

Every rank computes the plain op on the full tensors itself (the single-process reference)
and compares with its shard of the parallel op; it also counts the collectives that one
transformer layer issues. Results go to rank{r}.json.
"""

import json
from collections import Counter
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_megatron.models.gpt import GPTConfig, GPTModel, gpt_layer
from lightning_megatron.optim.grad_sync import LocalGradients
from lightning_megatron.optim.partial_grads import partial_grad_groups
from lightning_megatron.models.transformer import layer_tensor_parallel_plan
from lightning_megatron.parallel import ParallelConfig, ParallelState, TensorParallelRNG
from lightning_megatron.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelCrossEntropy,
    VocabParallelEmbedding,
    VocabParallelHead,
    full_sequences,
    gather_from_tensor_parallel,
    parallelize,
    scatter_to_sequence,
)
from lightning_megatron.tensor_parallel.overlap import OverlappedSequenceParallelLinear
from entry import run_script


def main(out_dir: Path, args: list[str]) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    state = ParallelState.create(ParallelConfig(tensor_parallel_size=world), "cpu")
    sp_state = ParallelState.create(ParallelConfig(tensor_parallel_size=world, sequence_parallel=True), "cpu")
    group = state.tensor_parallel_group
    errors: dict[str, float] = {}

    def err(name, a, b):
        errors[name] = max(errors.get(name, 0.0), (a.detach() - b.detach()).abs().max().item())

    def shard(t, dim):
        return t.chunk(world, dim=dim)[rank]

    torch.manual_seed(0)
    B, S, H, OUT = 2, 8, 16, 24
    x_full = torch.randn(B, S, H)
    grad_full = torch.randn(B, S, OUT)
    plain = nn.Linear(H, OUT)
    y_ref = plain(x_full.requires_grad_())
    y_ref.backward(grad_full)

    # Sequence parallelism also with the collectives overlapped with the GEMMs (tp_comm_overlap), the row layer's GEMM
    # and reduce-scatter in 2 pieces (each rank's chunk of 4 positions cut in 2).
    OVERLAPS = {"": None, "_tpo": OverlappedSequenceParallelLinear(),
                "_tpo2": OverlappedSequenceParallelLinear(row_chunks=2)}
    for sequence_parallel, overlap in [(False, ""), (True, ""), (True, "_tpo"), (True, "_tpo2")]:
        tag = ("_sp" if sequence_parallel else "") + overlap
        linear_kwargs = dict(group=group, sequence_parallel=sequence_parallel, sequence_linear=OVERLAPS[overlap])
        # Column-parallel: output features split.
        col = ColumnParallelLinear(H, OUT, **linear_kwargs)
        col.weight.data.copy_(shard(plain.weight.data, 0))
        col.bias.data.copy_(shard(plain.bias.data, 0))
        x = (shard(x_full.detach(), 1) if sequence_parallel else x_full.detach()).clone().requires_grad_()
        y = col(x)
        err("column_forward" + tag, y, shard(y_ref, 2))
        y.backward(shard(grad_full, 2))
        err("column_input_grad" + tag, x.grad, shard(x_full.grad, 1) if sequence_parallel else x_full.grad)
        err("column_weight_grad" + tag, col.weight.grad, shard(plain.weight.grad, 0))
        err("column_bias_grad" + tag, col.bias.grad, shard(plain.bias.grad, 0))

        # Row-parallel: input features split; output reduced (or reduce-scattered over the sequence).
        row = RowParallelLinear(H, OUT, **linear_kwargs)
        row.weight.data.copy_(shard(plain.weight.data, 1))
        row.bias.data.copy_(plain.bias.data)
        x = shard(x_full.detach(), 2).clone().requires_grad_()
        y = row(x)
        err("row_forward" + tag, y, shard(y_ref, 1) if sequence_parallel else y_ref)
        y.backward(shard(grad_full, 1) if sequence_parallel else grad_full)
        err("row_input_grad" + tag, x.grad, shard(x_full.grad, 2))
        err("row_weight_grad" + tag, row.weight.grad, shard(plain.weight.grad, 1))
        bias_grad = row.bias.grad.clone()
        if sequence_parallel:
            dist.all_reduce(bias_grad, group=group)  # what the gradient synchroniser does for marked params
        err("row_bias_grad" + tag, bias_grad, plain.bias.grad)

    # Sequence parallelism's column layer with a frozen weight (its bias trains), and with an input that needs no
    # gradient (the weight's still computed from the input gathered again in backward).
    for overlap in ("", "_tpo"):
        col = ColumnParallelLinear(H, OUT, group=group, sequence_parallel=True, sequence_linear=OVERLAPS[overlap])
        col.weight.data.copy_(shard(plain.weight.data, 0))
        col.bias.data.copy_(shard(plain.bias.data, 0))
        col.weight.requires_grad_(False)
        x = shard(x_full.detach(), 1).clone().requires_grad_()
        col(x).backward(shard(grad_full, 2))
        err("column_frozen_weight_input_grad_sp" + overlap, x.grad, shard(x_full.grad, 1))
        err("column_frozen_weight_bias_grad_sp" + overlap, col.bias.grad, shard(plain.bias.grad, 0))
        col.weight.requires_grad_(True)
        col(shard(x_full.detach(), 1)).backward(shard(grad_full, 2))
        err("column_no_input_grad_weight_grad_sp" + overlap, col.weight.grad, shard(plain.weight.grad, 0))

    class SavedBytes(torch.autograd.graph.saved_tensors_hooks):
        """The bytes of the storages saved for backward inside the block, each once, parameters' left out."""

        def __init__(self, module):
            self.parameters = {p.untyped_storage().data_ptr() for p in module.parameters()}
            self.storages = {}
            super().__init__(self.pack, lambda saved: saved)

        def pack(self, tensor):
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in self.parameters:
                self.storages[storage.data_ptr()] = storage.nbytes()
            return tensor

        def total(self):
            return sum(self.storages.values())

    # What a column layer saves for backward: the whole input without sequence parallelism, only this rank's sequence
    # chunk with it (the all-gathered sequence is not kept, default and overlapped alike); a frozen layer nothing.
    saved_bytes = {}
    for name, sequence_parallel, overlap, frozen in [("tp", False, "", False), ("sp", True, "", False),
                                                     ("sp_tpo", True, "_tpo", False), ("sp_frozen", True, "", True)]:
        col = ColumnParallelLinear(H, OUT, group=group, sequence_parallel=sequence_parallel,
                                   sequence_linear=OVERLAPS[overlap])
        col.weight.data.copy_(shard(plain.weight.data, 0))
        col.requires_grad_(not frozen)
        x = (shard(x_full.detach(), 1) if sequence_parallel else x_full.detach()).clone().requires_grad_()
        saved = SavedBytes(col)
        with saved:
            y = col(x)
        saved_bytes[name] = saved.total()
        y.backward(shard(grad_full, 2))
    # Under autocast the chunk is saved in the compute dtype (bf16: half the fp32 chunk), and the layer computes what the
    # same layer without sequence parallelism computes under autocast.
    autocast_outputs = {}
    for sequence_parallel in (False, True):
        col = ColumnParallelLinear(H, OUT, group=group, sequence_parallel=sequence_parallel)
        col.weight.data.copy_(shard(plain.weight.data, 0))
        col.bias.data.copy_(shard(plain.bias.data, 0))
        x = (shard(x_full.detach(), 1) if sequence_parallel else x_full.detach()).clone().requires_grad_()
        saved = SavedBytes(col)
        with saved, torch.autocast("cpu", dtype=torch.bfloat16):
            y = col(x)
        y.float().backward(shard(grad_full, 2))
        autocast_outputs[sequence_parallel] = (y.float(), x.grad, col.weight.grad)
        if sequence_parallel:
            saved_bytes["sp_autocast"] = saved.total()
            saved_bytes["sp_autocast_dtype"] = str(y.dtype)
            saved_bytes["weight_bf16"] = col.weight.numel() * 2  # autocast's copy of the weight, saved as F.linear does
    plain_out, plain_x_grad, plain_w_grad = autocast_outputs[False]
    sp_out, sp_x_grad, sp_w_grad = autocast_outputs[True]
    saved_bytes["sp_autocast_error"] = max(((a - b).abs().max() / b.abs().max()).item() for a, b in  # relative
                                           ((sp_out, plain_out), (sp_x_grad, shard(plain_x_grad, 1)), (sp_w_grad, plain_w_grad)))
    # The sequence scatter's chunk of a one-sample batch is contiguous already: it must still be a copy, not a view
    # that keeps the whole input alive (the first norm saves it).
    one_sample = torch.randn(1, S, H, generator=torch.Generator().manual_seed(7))  # (the global stream left as it was)
    saved_bytes["scatter_chunk_storage"] = scatter_to_sequence(one_sample, group).untyped_storage().nbytes()
    saved_bytes["scatter_input_storage"] = one_sample.untyped_storage().nbytes()

    # Whole sequences (generation's full_sequences): the overlapped layers act as plain tensor parallelism, on any length.
    whole_sequences = {}
    with full_sequences(), torch.no_grad():
        odd = x_full[:, :5]  # 5 positions: no sequence split of 2 ranks
        col = ColumnParallelLinear(H, OUT, group=group, sequence_parallel=True, sequence_linear=OVERLAPS["_tpo"])
        col.weight.data.copy_(shard(plain.weight.data, 0))
        col.bias.data.copy_(shard(plain.bias.data, 0))
        whole_sequences["column"] = bool((col(odd) - shard(plain(odd), 2)).abs().max() < 1e-5)
        row = RowParallelLinear(H, OUT, group=group, sequence_parallel=True, sequence_linear=OVERLAPS["_tpo2"])
        row.weight.data.copy_(shard(plain.weight.data, 1))
        row.bias.data.copy_(plain.bias.data)
        whole_sequences["row"] = bool((row(shard(odd, 2)) - plain(odd)).abs().max() < 1e-5)

    # Column with gathered output.
    col = ColumnParallelLinear(H, OUT, group=group, gather_output=True)
    col.weight.data.copy_(shard(plain.weight.data, 0))
    col.bias.data.copy_(shard(plain.bias.data, 0))
    x = x_full.detach().clone().requires_grad_()
    y = col(x)
    err("column_gathered_forward", y, y_ref)
    y.backward(grad_full)
    err("column_gathered_input_grad", x.grad, x_full.grad)

    # Vocab-parallel embedding, head and cross-entropy; vocab 37 pads to a multiple of world * 8.
    V = 37
    ids = torch.randint(0, V, (B, S))
    labels = torch.randint(0, V, (B, S))
    labels[0, :3] = -100
    emb_ref = nn.Embedding(V, H)
    hidden_ref = emb_ref(ids)
    logits_ref = hidden_ref @ emb_ref.weight.t()
    loss_ref = F.cross_entropy(logits_ref.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    loss_ref.backward()

    emb = VocabParallelEmbedding(V, H, group=group, pad_to_multiple_of=8)
    head = VocabParallelHead(H, V, group=group, pad_to_multiple_of=8)
    emb.weight.data.copy_(emb.weight.tensor_shard.local_slice(emb_ref.weight.data))
    head.weight = emb.weight
    loss_fn = VocabParallelCrossEntropy(group=group, reduction="sum")
    hidden = emb(ids)
    err("embedding_forward", hidden, hidden_ref)
    logits = head(hidden)
    padding_logits = logits[..., head.real_local_size:]
    errors["padding_logits_not_minus_inf"] = float((padding_logits != float("-inf")).sum())
    loss = loss_fn(logits.flatten(0, 1), labels.flatten())
    err("cross_entropy_forward", loss, loss_ref)
    loss.backward()
    err("tied_embedding_weight_grad", emb.weight.grad, emb.weight.tensor_shard.local_slice(emb_ref.weight.grad))
    errors["padding_rows_grad"] = emb.weight.grad[emb.weight.tensor_shard.real_local_size():].abs().sum().item()
    mean_loss = VocabParallelCrossEntropy(group=group)(logits.detach().flatten(0, 1), labels.flatten())
    err("cross_entropy_mean", mean_loss, loss_ref.detach() / (labels != -100).sum())

    # pad_vocab_to_multiple_of=1 through parallelize (the strategy's path) with a vocabulary that tp does not divide:
    # 257 ids pad to 258 rows (a multiple of tp * 1). Logits, loss and gradients must match plain PyTorch, and the full
    # state dict and a sharded checkpoint must keep the 257 real rows only.
    class TinyLM(nn.Module):
        def __init__(self, vocab, hidden):
            super().__init__()
            self.emb = nn.Embedding(vocab, hidden)
            self.head = nn.Linear(hidden, vocab, bias=False)
            self.head.weight = self.emb.weight
            self.loss = nn.CrossEntropyLoss(reduction="sum")

        def forward(self, ids, labels):
            logits = self.head(self.emb(ids))
            return logits, self.loss(logits.flatten(0, 1), labels.flatten())

    PAD1_VOCAB = 257
    torch.manual_seed(3)
    lm_ref = TinyLM(PAD1_VOCAB, H)
    lm = TinyLM(PAD1_VOCAB, H)
    lm.load_state_dict(lm_ref.state_dict())
    pad1_ids = torch.randint(0, PAD1_VOCAB, (B, S))
    pad1_ids[0, 0] = PAD1_VOCAB - 1  # the last real id sits on the last rank, next to the padding row
    pad1_labels = torch.randint(0, PAD1_VOCAB, (B, S))
    pad1_labels[1, :2] = torch.tensor([PAD1_VOCAB - 1, -100])
    pad1_logits_ref, pad1_loss_ref = lm_ref(pad1_ids, pad1_labels)
    pad1_loss_ref.backward()
    pad1: dict = {}
    try:
        parallelize(lm, {"emb": "vocab", "head": "vocab", "loss": "vocab"}, state, pad_vocab_to_multiple_of=1)
    except Exception as error:  # the same on every rank (before any collective); reported, not fatal for the rest
        pad1["error"] = f"{type(error).__name__}: {error}"
    if "error" not in pad1:
        from lightning_megatron.checkpoint.entries import model_entries
        from lightning_megatron.checkpoint.full import gather_full_state_dict
        from lightning_megatron.checkpoint.sharded import save_sharded

        weight_shard = lm.emb.weight.tensor_shard
        pad1["padded_rows"] = weight_shard.padded_size
        pad1["local_rows"] = lm.emb.weight.shape[0]
        pad1["tied"] = lm.head.weight is lm.emb.weight
        pad1_logits, pad1_loss = lm(pad1_ids, pad1_labels)
        pad1["padding_logits_not_minus_inf"] = int((pad1_logits[..., lm.head.real_local_size:] != float("-inf")).sum())
        pad1["padding_logits"] = pad1_logits.shape[-1] - lm.head.real_local_size
        full_logits = gather_from_tensor_parallel(pad1_logits.detach(), group)
        pad1["gathered_logit_columns"] = full_logits.shape[-1]
        pad1["logits_error"] = (full_logits[..., :PAD1_VOCAB] - pad1_logits_ref.detach()).abs().max().item()
        pad1["loss"], pad1["loss_ref"] = pad1_loss.item(), pad1_loss_ref.item()
        pad1_loss.backward()
        grad = gather_from_tensor_parallel(lm.emb.weight.grad.t(), group).t()  # padding rows included: they must stay 0
        pad1["weight_grad_error"] = (grad[:PAD1_VOCAB] - lm_ref.emb.weight.grad).abs().max().item()
        pad1["padding_rows_grad"] = grad[PAD1_VOCAB:].abs().sum().item()
        full_state = gather_full_state_dict(lm, group)
        pad1["full_state_shapes"] = {name: list(t.shape) for name, t in full_state.items()}
        pad1["full_state_error"] = max((full_state[name] - t).abs().max().item() for name, t in lm_ref.state_dict().items())
        if rank == 0:
            torch.save({name: t.detach().clone() for name, t in lm_ref.state_dict().items()}, out_dir / "pad1_reference.pt")
        save_sharded(out_dir / "pad1_checkpoint", model_entries(lm), {}, {})

    # The chunked loss (GPTConfig.loss_chunk_tokens) at tp2 and tp2+SP against the unchunked single-process model on
    # the whole batch: vocabulary 257 pads to 512 (rank 1 holds one real id and 255 padding rows), tied and untied, a
    # chunk of 7 tokens (3 of each rank under SP) that divides neither the batch's 32 tokens nor a rank's 16 under SP,
    # ignored labels.
    chunked_loss: dict[str, float] = {}
    for tied in (True, False):
        chunk_config = GPTConfig(vocab_size=257, max_seq_length=S, hidden_size=H, num_layers=2, num_heads=4,
                                 tie_embeddings=tied)
        torch.manual_seed(4)
        chunk_ref = GPTModel(chunk_config)
        chunk_ids = torch.randint(0, 257, (B, S), generator=torch.Generator().manual_seed(6))
        chunk_labels = torch.roll(chunk_ids, -1, dims=1)
        chunk_labels[0, :3], chunk_labels[1, -1] = -100, 256  # ignored tokens; the id rank 1 holds among padding
        ref_sum, ref_tokens = chunk_ref.loss(chunk_ids, chunk_labels)
        (ref_sum / ref_tokens).backward()
        for tag, chunk_state in (("", state), ("_sp", sp_state)):
            name = f"{'tied' if tied else 'untied'}{tag}"
            chunked = GPTModel(replace(chunk_config, loss_chunk_tokens=7))
            chunked.load_state_dict(chunk_ref.state_dict())
            parallelize(chunked, chunked.tensor_parallel_plan(), chunk_state)
            loss_sum, tokens = chunked.loss(chunk_ids, chunk_labels)
            (loss_sum / tokens).backward()
            reference_loss = (ref_sum / ref_tokens).item()
            chunked_loss[f"{name}_loss"] = abs((loss_sum / tokens).item() - reference_loss) / reference_loss  # relative
            reference_grads = dict(chunk_ref.named_parameters())
            worst = 0.0
            for param_name, param in chunked.named_parameters():
                grad = param.grad
                if getattr(param, "sequence_parallel_grad", False):  # partial sums over the sequence chunks
                    grad = grad.clone()
                    dist.all_reduce(grad, group=group)
                full = reference_grads[param_name].grad
                expected = param.tensor_shard.local_slice(full) if hasattr(param, "tensor_shard") else full
                worst = max(worst, (grad - expected).abs().max().item())
            chunked_loss[f"{name}_grads"] = worst
            chunked_loss[f"{name}_head_grad_norm"] = chunked.lm_head.weight.grad.norm().item()  # not all zero

    # Count the collectives of one transformer layer, forward and backward separately.
    COLLECTIVES = ["all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
                   "reduce_scatter_tensor", "reduce_scatter_single",
                   "broadcast", "send", "recv", "isend", "irecv", "barrier", "all_to_all", "all_to_all_single", "reduce"]
    counts: Counter = Counter()
    COLLECTIVES = [name for name in COLLECTIVES if hasattr(dist, name)]
    originals = {name: getattr(dist, name) for name in COLLECTIVES}

    def counting(name):
        def call(*args, **kwargs):
            counts[name] += 1
            return originals[name](*args, **kwargs)
        return call

    # GPT-2's layer, a Llama layer whose 2 key/value groups split over tp=2, and a multi-query one (1 group: replicated).
    LAYER_CONFIGS = {
        "gpt2": GPTConfig(hidden_size=H, num_heads=4),
        "llama": GPTConfig.from_name("llama-tiny", hidden_size=H, ffn_hidden_size=24),
        "mqa": GPTConfig.from_name("llama-tiny", hidden_size=H, ffn_hidden_size=24, num_query_groups=1),
    }
    layer_counts = {}
    KINDS = (("tp", state, None), ("tp_sp", sp_state, None), ("tp_sp_tpo", sp_state, OVERLAPS["_tpo"]),
             ("tp_sp_tpo2", sp_state, OVERLAPS["_tpo2"]))
    for layout, layer_state, overlap in [(f"{model}_{kind}", kind_state, overlap) for model in LAYER_CONFIGS
                                         for kind, kind_state, overlap in KINDS]:
        torch.manual_seed(1)
        config = LAYER_CONFIGS[layout.split("_")[0]]
        layer = gpt_layer(config)
        plan = layer_tensor_parallel_plan("layer", num_heads=config.num_heads, num_query_groups=config.num_query_groups,
                                          gated_mlp=config.activation == "swiglu")
        parallelize(layer, {k.replace("layer.", ""): v for k, v in plan.items() if k != "layer"}, layer_state,
                    sequence_linear=overlap)
        seq = S // world if "_tp_sp" in layout else S
        x = torch.randn(B, seq, H, requires_grad=True)
        for name in COLLECTIVES:
            setattr(dist, name, counting(name))
        try:
            counts.clear()
            y = layer(x)
            forward_counts = dict(counts)
            counts.clear()
            y.sum().backward()
            backward_counts = dict(counts)
        finally:
            for name in COLLECTIVES:
                setattr(dist, name, originals[name])
        layer_counts[layout] = {"forward": forward_counts, "backward": backward_counts}

    # One optimizer step's reductions after backward: replicated key/value heads (multi-query at tp=2) add one all-reduce
    # over their replicas for all layers together; split groups (llama) add none.
    step_counts = {}
    for model_name in ("mqa", "llama"):
        torch.manual_seed(2)
        step_model = GPTModel(replace(LAYER_CONFIGS[model_name], num_layers=3, vocab_size=64, max_seq_length=S))
        parallelize(step_model, step_model.tensor_parallel_plan(), state)
        step_params = list(step_model.parameters())
        step_sync = LocalGradients(step_params, partial_grad_groups=partial_grad_groups(step_params, state))
        step_ids = torch.randint(0, 64, (B, S), generator=torch.Generator().manual_seed(3))
        step_loss, step_tokens = step_model.loss(step_ids, step_ids)
        step_loss.backward()
        for name in COLLECTIVES:
            setattr(dist, name, counting(name))
        try:
            counts.clear()
            step_sync.finish(step_tokens)
            step_counts[model_name] = {"collectives": dict(counts),
                                       "parts": sum(len(g.parts) for g in step_sync.partial_grad_groups)}
        finally:
            for name in COLLECTIVES:
                setattr(dist, name, originals[name])

    # Dropout streams: replicated regions draw the same mask on every tp rank, sharded regions differ.
    seed_generator = TensorParallelRNG(99, state.tensor_parallel_rank, torch.device("cpu"))
    torch.manual_seed(5)
    regions = nn.ModuleDict({"replicated": nn.Dropout(0.5), "heads": nn.Dropout(0.5), "chunks": nn.Dropout(0.5)})
    parallelize(regions, {"heads": "sharded_dropout", "chunks": "sequence_parallel"}, sp_state, rng=seed_generator)
    same_mask = {}
    for name, dropout in regions.items():
        mask = (dropout(torch.ones(64)) == 0).float()
        masks = [torch.empty_like(mask) for _ in range(world)]
        dist.all_gather(masks, mask, group=group)
        same_mask[name] = all(torch.equal(masks[0], m) for m in masks)

    (out_dir / f"rank{rank}.json").write_text(json.dumps({"errors": errors, "counts": layer_counts, "step_counts": step_counts, "same_dropout_mask": same_mask,
                                                             "whole_sequences": whole_sequences,
                                                             "saved_bytes": saved_bytes,
                                                             "pad1": pad1, "chunked_loss": chunked_loss}))
    dist.barrier()


if __name__ == "__main__":
    run_script(main)
