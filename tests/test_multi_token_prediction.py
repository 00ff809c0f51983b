"""Multi-token prediction (``GPTConfig.mtp``) in one process, against the formula written out in plain PyTorch."""

import pytest
import torch
import torch.nn.functional as F

from lightning_megatron.models import GPT, GPTConfig, GPTModel
from lightning_megatron.models.multi_token_prediction import MTPConfig

LLAMA = dict(vocab_size=53, max_seq_length=16, hidden_size=32, num_layers=2, num_heads=4, num_query_groups=2,
             ffn_hidden_size=48, normalization="RMSNorm", position_embedding_type="rope", activation="swiglu",
             add_bias_linear=False, tie_embeddings=False)
GPT2 = dict(vocab_size=53, max_seq_length=16, hidden_size=32, num_layers=2, num_heads=4)


def reference_loss(model: GPTModel, input_ids, labels, document_ids=None, position_ids=None):
    """``L_main + factor / D * sum_k L_k`` (sums of token losses) and the depths' sums, from the model's trunk and
    its depths' weights, position by position: depth k at t targets labels[t + k] where t + k is in t's document."""
    mtp = model.config.mtp
    layer_kwargs = model.layer_kwargs(position_ids=position_ids, document_ids=document_ids)
    hidden = model.embedding(input_ids, position_ids)
    for block in model.blocks.values():
        hidden = block(hidden, **layer_kwargs)
    hidden = model.ln_f(hidden)  # the first depth reads what the head reads (Megatron-Core's decoder output)
    main = F.cross_entropy(model.lm_head(hidden).flatten(0, 1), labels.flatten(), reduction="sum")
    batch, seq = input_ids.shape
    sums = []
    for k, depth in enumerate(model.mtp.depths.values(), start=1):
        ahead, positions = torch.zeros_like(input_ids), torch.zeros_like(input_ids)
        ahead[:, :seq - k] = input_ids[:, k:]
        positions[:, :seq - k] = (torch.arange(seq) if position_ids is None else position_ids)[..., k:]
        embedded = model.embedding(ahead, positions)  # the shared table (learned positions: those of t + k)

        def norm(module, x):
            return F.layer_norm(x, (x.shape[-1],), module.weight, module.bias, module.eps) if isinstance(
                module, torch.nn.LayerNorm) else F.rms_norm(x, (x.shape[-1],), module.weight, module.eps)

        joined = torch.cat([norm(depth.enorm, embedded), norm(depth.hnorm, hidden)], dim=-1)
        hidden = norm(depth.norm, depth.layer(joined @ depth.eh_proj.weight.T, **layer_kwargs))  # the next depth's input
        logits = hidden @ model.lm_head.weight.T
        total = logits.new_zeros(())
        for b in range(batch):
            for t in range(seq - k):
                same = document_ids is None or document_ids[b, t] == document_ids[b, t + k]
                if same and labels[b, t + k] != -100:
                    total = total + F.cross_entropy(logits[b, t], labels[b, t + k])
        sums.append(total)
    return main + mtp.loss_scaling_factor / mtp.num_layers * sum(sums), main, torch.stack(sums)


def packed_batch(vocab: int, seq: int = 16):
    torch.manual_seed(3)
    input_ids = torch.randint(0, vocab, (2, seq))
    labels = torch.cat([input_ids[:, 1:], torch.full((2, 1), -100)], dim=1)
    labels[1, :3] = -100  # a prompt without loss
    document_ids = torch.tensor([[0] * 6 + [1] * 7 + [2] * 3, [0] * 11 + [1] * 5])
    position_ids = torch.cat([torch.cat([torch.arange(6), torch.arange(7), torch.arange(3)]),
                              torch.cat([torch.arange(11), torch.arange(5)])]).view(2, seq)
    return input_ids, labels, document_ids, position_ids


@pytest.mark.parametrize("base, depths, packed", [(LLAMA, 2, True), (GPT2, 1, True), (LLAMA, 1, False),
                                                  ({**LLAMA, "loss_chunk_tokens": 5}, 2, True)])
def test_loss_and_gradients_match_the_formula(base, depths, packed):
    torch.manual_seed(0)
    model = GPTModel(GPTConfig(**base, mtp=MTPConfig(num_layers=depths, loss_scaling_factor=0.3)))
    input_ids, labels, document_ids, position_ids = packed_batch(model.config.vocab_size)
    side = dict(document_ids=document_ids, position_ids=position_ids) if packed else {}
    loss_sum, num_tokens = model.loss(input_ids, labels, **side)
    loss_sum.backward()
    got = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    expected, main, depth_sums = reference_loss(model, input_ids, labels, **side)
    expected.backward()
    torch.testing.assert_close(loss_sum, main)  # the value reported is the main loss
    assert num_tokens == (labels != -100).sum()
    torch.testing.assert_close(model.mtp_statistics[0], depth_sums.detach())
    assert all(p.grad is not None for p in model.mtp.parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name], p.grad, msg=name)


def test_off_by_default_and_the_trunk_is_unchanged():
    """No ``mtp``: no depths, no extra parameters, and the same trunk values and loss as a model with them."""
    assert GPTConfig().mtp is None
    torch.manual_seed(0)
    plain = GPTModel(GPTConfig(**LLAMA))
    torch.manual_seed(0)
    with_mtp = GPTModel(GPTConfig(**LLAMA, mtp={"num_layers": 1}))
    assert plain.mtp is None and not any("mtp" in name for name, _ in plain.named_parameters())
    for name, p in plain.named_parameters():
        assert torch.equal(p, with_mtp.get_parameter(name)), name
    input_ids, labels, document_ids, position_ids = packed_batch(LLAMA["vocab_size"])
    assert torch.equal(plain.loss(input_ids, labels)[0], with_mtp.loss(input_ids, labels)[0])
    with_mtp.eval()  # evaluation runs no depth
    with_mtp.mtp_statistics = None
    with_mtp.loss(input_ids, labels)
    assert with_mtp.mtp_statistics is None


def test_counts_configs_and_exports(tmp_path):
    """Parameters counted as built (the MTP layer MoE where the last layer is); bad configs and cp refused by
    name; ``to_hf`` leaves the depths out with a warning and writes what transformers loads."""
    moe = GPTConfig(**LLAMA, moe={"num_experts": 4, "top_k": 2, "ffn_hidden_size": 16}, mtp={"num_layers": 2})
    model = GPTModel(moe)
    assert sum(p.numel() for p in model.parameters()) == moe.num_parameters()
    assert type(model.mtp.depths["1"].layer.mlp).__name__ == "MoE"
    assert moe.flops_per_batch(2, 16) > GPTConfig(**LLAMA, moe=moe.moe).flops_per_batch(2, 16)
    with pytest.raises(ValueError, match=r"MTPConfig.num_layers=0"):
        MTPConfig(num_layers=0)
    with pytest.raises(ValueError, match=r"loss_scaling_factor=-1"):
        MTPConfig(loss_scaling_factor=-1)
    gpt = GPT(GPTConfig(**LLAMA, mtp={"num_layers": 1}))
    gpt.configure_model()
    from lightning_megatron.parallel.config import ParallelConfig
    with pytest.raises(ValueError, match=r"context_parallel_size=2 with multi-token prediction"):
        gpt.validate_parallel_config(ParallelConfig(context_parallel_size=2))
    for schedule in ("interleaved_zero_bubble", "zbv", "dualpipev"):
        with pytest.raises(ValueError, match=rf"pipeline_schedule='{schedule}' with multi-token prediction"):
            gpt.validate_pipeline_schedule(schedule)
    for schedule in ("1f1b", "gpipe", "interleaved_1f1b"):
        gpt.validate_pipeline_schedule(schedule)
    with pytest.warns(UserWarning, match=r"multi-token prediction depths .* are left out"):
        gpt.to_hf(tmp_path)
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    input_ids = torch.randint(0, LLAMA["vocab_size"], (1, 8))
    torch.testing.assert_close(hf(input_ids).logits, gpt(input_ids))
    assert gpt.config.mtp is not None
