"""BERT: Hugging Face parity, tensor-parallel layouts and a Trainer run vs one process, the masking, bad input."""

from dataclasses import replace
from types import SimpleNamespace

import lightning as L
import numpy as np
import pytest
import torch
from torch.utils.data import default_collate

from launch import run_job
from workers.bert_setup import CLIP, CONFIGS, SEED, batches, fit_datamodule, fit_model, fit_trainer_kwargs, model_loss, optimizer
from lightning_megatron.huggingface.bert import bert_config_from_hf, bert_state_dict_from_hf
from lightning_megatron.data import BERTDataModule, BERTPretrainingDataset
from lightning_megatron.data.bert import BYTE_SPECIAL_TOKENS
from lightning_megatron.data.corpus import load_stdlib_token_documents
from lightning_megatron.models import BERT, BERTConfig, BERTModel

LAYOUTS = ["pre-tp2-dp1", "pre-tp2-dp1-sp", "post-tp2-dp1-sp", "pre-tp1-dp2", "pre-pp2-tp1-dp1", "post-pp2-tp1-dp1"]
LOSS_TOL, WEIGHT_TOL = 1e-5, 1e-5


# ----------------------------------------------------------------------------- Hugging Face parity
@pytest.mark.parametrize("hf_class", ["BertForMaskedLM", "BertForPreTraining"])
def test_post_norm_bert_matches_hugging_face(hf_class):
    transformers = pytest.importorskip("transformers")
    config = BERTConfig(vocab_size=261, max_seq_length=32, hidden_size=64, num_heads=4, num_layers=2,
                        norm_position="post", layer_norm_eps=1e-12, binary_head=hf_class == "BertForPreTraining")
    hf_config = transformers.BertConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads, intermediate_size=config.ffn_size, hidden_act="gelu",
        max_position_embeddings=config.max_seq_length, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        layer_norm_eps=config.layer_norm_eps,
    )
    torch.manual_seed(0)
    hf = getattr(transformers, hf_class)(hf_config).eval()
    with torch.no_grad():  # random everything, biases and LayerNorm gains included, so no mapping error hides
        for param in hf.parameters():
            param.normal_(0.0, 0.5)
    assert bert_config_from_hf(hf.config, binary_head=config.binary_head) == config
    model = BERTModel(config).eval()
    model.load_state_dict(bert_state_dict_from_hf(hf.state_dict(), config))

    input_ids = torch.randint(0, config.vocab_size, (3, 24))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 17:], attention_mask[2, 6:] = 0, 0
    token_type_ids = (torch.arange(24) >= 10).long().expand(3, 24)
    with torch.no_grad():
        expected = hf(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
        got = model(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
    expected_logits = expected.logits if hf_class == "BertForMaskedLM" else expected.prediction_logits
    deviation = (got.logits - expected_logits).abs().max().item()
    print(f"{hf_class}: max |logit difference| {deviation:.2e} (logits up to {expected_logits.abs().max():.1f})")
    assert deviation <= 1e-4
    if config.binary_head:
        binary_deviation = (got.binary_logits - expected.seq_relationship_logits).abs().max().item()
        print(f"{hf_class}: max |sentence-order logit difference| {binary_deviation:.2e}")
        assert binary_deviation <= 1e-4
    else:
        assert got.binary_logits is None


# ----------------------------------------------------------------------------- parallel vs one process
def reference_run(config: BERTConfig):
    """Plain PyTorch, one process, the whole global batch, torch's own clipping."""
    torch.manual_seed(SEED)
    model = BERTModel(config)
    opt = optimizer(model.parameters())
    losses, correct = [], []
    for batch in batches():
        out = model_loss(model, batch)
        (out.loss_sum / out.num_tokens).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(out.loss_sum.item() / out.num_tokens.item())
        correct.append(out.num_correct.item())
    return losses, correct, {k: v.detach().clone() for k, v in model.state_dict().items()}


def plain_lightning_fit():
    """The Trainer run of the worker with Lightning's default single-device strategy."""
    L.seed_everything(7)
    losses = []

    class RecordLosses(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))

    trainer = L.Trainer(accelerator="cpu", devices=1, callbacks=[RecordLosses()], **fit_trainer_kwargs())
    model = fit_model()
    trainer.fit(model, datamodule=fit_datamodule())
    return losses, {k: float(v) for k, v in trainer.callback_metrics.items()}, model.state_dict()


@pytest.fixture(scope="module")
def parallel_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bert")
    results, _ = run_job("bert_parallel", 2, out, ",".join(LAYOUTS))
    return out, results


@pytest.mark.slow
def test_tensor_parallel_layouts_match_single_process(parallel_run):
    out, _ = parallel_run
    references = {norm: reference_run(config) for norm, config in CONFIGS.items()}
    for layout in LAYOUTS:
        ref_losses, ref_correct, ref_weights = references[layout.split("-")[0]]
        result = torch.load(out / f"{layout}.pt", weights_only=True)
        assert len(result["losses"]) == len(ref_losses)
        loss_dev = max(abs(a - b) for a, b in zip(result["losses"], ref_losses))
        assert result["weights"].keys() == ref_weights.keys()
        weight_dev = {k: (result["weights"][k] - ref_weights[k]).abs().max().item() for k in ref_weights}
        worst = max(weight_dev, key=weight_dev.get)
        print(f"{layout}: worst loss deviation {loss_dev:.2e}, worst weight deviation {weight_dev[worst]:.2e} ({worst})")
        assert loss_dev < LOSS_TOL, f"{layout}: losses {result['losses']} vs reference {ref_losses}"
        assert weight_dev[worst] < WEIGHT_TOL, f"{layout}: {worst} deviates by {weight_dev[worst]:.2e}"
        # the vocab-parallel argmax finds the same predictions as argmax over the full logits
        assert result["correct"] == ref_correct


@pytest.mark.slow
def test_trainer_fit_tp2_matches_plain_lightning(parallel_run):
    out, results = parallel_run
    assert len(results) == 2 and all(r["global_step"] == 2 for r in results)
    assert results[0]["fit_losses"] == results[1]["fit_losses"], "the two tp ranks must see the same loss"
    ref_losses, ref_metrics, ref_weights = plain_lightning_fit()
    metrics = results[0]["fit_metrics"]
    assert {"train_loss", "train_accuracy", "val_loss", "val_accuracy", "val_sentence_order_loss"} <= metrics.keys()
    assert np.allclose(results[0]["fit_losses"], ref_losses, atol=1e-5), (results[0]["fit_losses"], ref_losses)
    for name in ("val_loss", "val_accuracy", "val_sentence_order_loss"):
        assert abs(metrics[name] - ref_metrics[name]) < 1e-5, (name, metrics[name], ref_metrics[name])
    weights = torch.load(out / "fit_weights.pt", weights_only=True)
    assert weights["model.embeddings.word_embeddings.weight"].shape == (261, 64)  # global, unpadded
    assert weights["model.mlm_head.decoder.bias"].shape == (261,)
    deviation = {k: (weights[k] - ref_weights[k]).abs().max().item() for k in ref_weights}
    worst = max(deviation, key=deviation.get)
    print(f"Trainer.fit tp=2 vs plain Lightning: worst weight deviation {deviation[worst]:.2e} ({worst})")
    assert deviation[worst] < 1e-5, f"{worst} deviates by {deviation[worst]:.2e}"


# ----------------------------------------------------------------------------- data
def _datamodule(dp_size, dp_rank, **kwargs):
    dm = BERTDataModule(**kwargs)
    dm.trainer = SimpleNamespace(strategy=SimpleNamespace(distributed_sampler_kwargs={"num_replicas": dp_size, "rank": dp_rank}))
    dm.setup("fit")
    return dm


def _rows(batch):
    keys = ("input_ids", "labels", "attention_mask", "token_type_ids")
    rows = torch.cat([batch[k] for k in keys] + [batch["sentence_order_label"][:, None]], dim=1)
    return [tuple(row) for row in rows.tolist()]


def test_masking_is_deterministic_and_layout_independent():
    config = dict(seq_length=48, global_batch_size=8, max_files=12, split="80,10,10", seed=5)
    single = _datamodule(1, 0, **config)
    ranks = [_datamodule(2, r, **config) for r in range(2)]
    assert [dm.per_rank_batch_size for dm in ranks] == [4, 4]
    for name in ("train_dataloader", "val_dataloader"):
        single_batches = list(getattr(single, name)())
        rank_batches = [list(getattr(dm, name)()) for dm in ranks]
        for step in range(3):
            got = _rows(rank_batches[0][step]) + _rows(rank_batches[1][step])
            assert sorted(got) == sorted(_rows(single_batches[step]))
    dataset = single.train_dataset
    again = BERTPretrainingDataset(dataset.documents, seq_length=48, seed=5)
    for index in (0, 17, len(dataset) - 1):
        assert all(torch.equal(dataset[index][k], again[index][k]) for k in dataset[index])
    other_seed = BERTPretrainingDataset(dataset.documents, seq_length=48, seed=6)
    assert not all(torch.equal(dataset[i]["labels"], other_seed[i]["labels"]) for i in range(10))


def test_samples_structure_and_80_10_10_masking():
    special = BYTE_SPECIAL_TOKENS
    assert (special.pad_id, special.cls_id, special.sep_id, special.mask_id, special.vocab_size) == (257, 258, 259, 260, 261)
    assert BERTConfig.from_name("bert-tiny").vocab_size == BERTDataModule().vocab_size == special.vocab_size

    dataset = BERTPretrainingDataset(load_stdlib_token_documents(max_files=20), seq_length=64, seed=0)
    batch = default_collate([dataset[i] for i in range(0, len(dataset), max(1, len(dataset) // 600))])
    ids, labels, mask, types = batch["input_ids"], batch["labels"], batch["attention_mask"], batch["token_type_ids"]
    real = mask.sum(1)
    assert (ids[:, 0] == special.cls_id).all()
    assert (ids.gather(1, (real - 1)[:, None]) == special.sep_id).all()
    assert ((ids == special.pad_id) == (mask == 0)).all() and (real < 64).any(), "padded samples must exist"
    assert ((ids == special.sep_id).sum(1) == 2).all()
    positions = torch.arange(64)
    first_sep = (ids == special.sep_id).int().argmax(1)
    assert torch.equal(types.bool(), (positions > first_sep[:, None]) & (mask == 1))

    targets = labels != -100
    segment_tokens = real - 3
    expected = torch.tensor([max(1, round(0.15 * n)) for n in segment_tokens.tolist()])
    assert torch.equal(targets.sum(1), expected), "exactly round(15%) of each sample's segment tokens"
    assert (labels[targets] < 256).all(), "special tokens are never prediction targets"
    masked, kept = ids[targets] == special.mask_id, ids[targets] == labels[targets]
    replaced = ~masked & ~kept
    total = targets.sum().item()
    shares = [x.sum().item() / total for x in (masked, replaced, kept)]
    print(f"{total} masked tokens: [MASK] {shares[0]:.3f}, random {shares[1]:.3f}, kept {shares[2]:.3f}")
    assert total > 3000
    assert abs(shares[0] - 0.8) < 0.03 and abs(shares[1] - 0.1) < 0.02 and abs(shares[2] - 0.1) < 0.02
    assert (ids[targets][replaced] < 256).all(), "random replacements are ordinary tokens"
    order = batch["sentence_order_label"].float().mean().item()
    assert 0.4 < order < 0.6


# ----------------------------------------------------------------------------- bad input
def test_bad_input_raises_clear_errors():
    config = BERTConfig(hidden_size=48, num_heads=3)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 does not divide num_heads=3.*\[1, 3\]"):
        config.validate_tensor_parallel_size(2)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 does not divide num_heads=3"):
        BERT(config).validate_parallel_config(SimpleNamespace(tensor_parallel_size=2, context_parallel_size=1, pipeline_parallel_size=1,
                                                              virtual_pipeline_size=1, pipeline_layers_per_stage=None))
    with pytest.raises(ValueError, match=r"num_layers=2 does not divide into .* 4 \* 1 = 4"):
        BERT().validate_parallel_config(SimpleNamespace(tensor_parallel_size=1, context_parallel_size=1, pipeline_parallel_size=4,
                                                        virtual_pipeline_size=1, pipeline_layers_per_stage=None))
    with pytest.raises(ValueError, match=r"Unknown BERT preset 'bert-huge'\. Available presets: bert-1\.3b, bert-3\.9b"):
        BERT("bert-huge")
    with pytest.raises(ValueError, match=r"norm_position='sandwich'"):
        BERTConfig(norm_position="sandwich")
    with pytest.raises(ValueError, match=r"hidden_size=50 is not divisible by num_heads=4"):
        BERTConfig(hidden_size=50)

    model = BERTModel(BERTConfig(max_seq_length=16))
    ids = torch.zeros(2, 16, dtype=torch.long)
    with pytest.raises(ValueError, match=r"no sentence-order labels.*sentence_order=True.*binary_head=False"):
        model.loss(ids, ids)
    with pytest.raises(ValueError, match=r"Sequence length 17 exceeds max_seq_length=16"):
        model(torch.zeros(2, 17, dtype=torch.long))

    dm = BERTDataModule(seq_length=32, sentence_order=False)
    for bad_config, message in [
        (BERTConfig(vocab_size=257), r"vocab_size=257 is smaller than the 261 ids"),
        (BERTConfig(max_seq_length=16), r"seq_length=32 exceeds the model's max_seq_length=16"),
        (BERTConfig(), r"sentence-order head.*sentence_order=False"),
    ]:
        dm.trainer = SimpleNamespace(strategy=None, lightning_module=SimpleNamespace(config=bad_config))
        with pytest.raises(ValueError, match=message):
            dm.setup("fit")
    with pytest.raises(ValueError, match=r"seq_length=4 is too short"):
        BERTPretrainingDataset([], seq_length=4, seed=0)


def test_presets_have_the_papers_sizes():
    sizes = {}
    for name, expected in [("bert-base", 110e6), ("bert-large", 336e6), ("bert-1.3b", 1.3e9), ("bert-3.9b", 3.9e9)]:
        config = BERTConfig.from_name(name)
        with torch.device("meta"):
            sizes[name] = sum(p.numel() for p in BERTModel(config).parameters())
        assert abs(sizes[name] / expected - 1) < 0.02, (name, sizes[name])
        assert config.vocab_size == 30522 and config.max_seq_length == 512 and config.norm_position == "pre"
    assert replace(BERTConfig.from_name("bert-base"), norm_position="post").norm_position == "post"
    BERTConfig.from_name("bert-3.9b").validate_tensor_parallel_size(8)  # the paper's layout
