"""``HFCausalLM``: transformers' own modules, split by the plans their configs carry, against transformers itself (one
process: logits, loss, packed documents) and against one process at tp2 x dp2 / pp2 x dp2 with ZeRO (the pooled
job)."""

import json

import pytest
import torch
import torch.nn.functional as F

from launch import run_job
from workers.gpt_setup import CLIP, LORA, SEED, batches, document_batches, optimizer
from workers.hf_causal_setup import FAMILIES, PREDICT_IDS, save_family
from lightning_megatron.models import HFCausalLM
from lightning_megatron.models.hf_family import TP_STYLES, read_config
from lightning_megatron.models.hf_weights import SafetensorsWeights
from lightning_megatron.parallel import ParallelConfig

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_families")
    for name in FAMILIES:
        save_family(name, root / name)
    return root


def _reference_model(directory):
    return transformers.AutoModelForCausalLM.from_pretrained(directory, attn_implementation="sdpa").eval()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_and_loss_are_transformers(family, family_dirs):
    """Every family's logits (1e-4) and loss (1e-5) are transformers' own, -100 labels ignored; a packed sample's
    second document (document ids, positions restarting) gives the logits transformers gives that document alone
    (Gemma 3: through its sliding window)."""
    reference, module = _reference_model(family_dirs / family), HFCausalLM.from_hf(family_dirs / family)
    input_ids, labels = batches()[0]
    with torch.no_grad():
        expected = reference(input_ids).logits
        logits = module(input_ids)
        loss_sum, tokens = module.model.loss(input_ids, labels)
        expected_loss = F.cross_entropy(expected.flatten(0, 1), labels.flatten(), ignore_index=-100)
        # transformers' own loss of the same tokens: its labels are shifted inside (the last position has none)
        hf_loss = reference(input_ids, labels=input_ids).loss
        ours_shifted = F.cross_entropy(logits[:, :-1].flatten(0, 1), input_ids[:, 1:].flatten())
        split = 7
        positions = torch.cat([torch.arange(split), torch.arange(16 - split)]).expand(8, -1)
        documents = torch.cat([torch.zeros(split), torch.ones(16 - split)]).long().expand(8, -1)
        packed = module(input_ids, position_ids=positions, document_ids=documents)
        alone = reference(input_ids[:, split:]).logits
    assert (logits - expected).abs().max() < 1e-4
    assert (module.predict_step({"input_ids": input_ids})["logits"] - expected).abs().max() < 1e-4
    assert abs(loss_sum / tokens - expected_loss) < 1e-5 and tokens == (labels != -100).sum()
    assert abs(ours_shifted - hf_loss) < 1e-5
    assert (packed[:, split:] - alone).abs().max() < 1e-4
    assert (packed[:, :split] - logits[:, :split]).abs().max() < 1e-4


def test_a_rank_reads_its_part_of_each_tensor(family_dirs):
    """The reader gives each rank its part of a tensor, read by slices of the file (padded vocabulary rows zero, a
    segmented split, a split of the columns): what slicing the whole tensor gives."""
    from lightning_megatron.parallel.shards import TensorShard

    weights = SafetensorsWeights(family_dirs / "phi3")
    name = "model.layers.0.self_attn.qkv_proj.weight"
    full = weights.read_local(name, None, (64, 32))
    embedding = weights.read_local("model.embed_tokens.weight", None, (257, 32))
    segmented = (((0, 16), (32, 16)), ((16, 16), (48, 16)))
    shards = [(name, TensorShard(0, (64, 32), 64, 1, 2, rank_ranges=segmented)),
              (name, TensorShard(1, (64, 32), 32, 0, 4)),
              ("model.embed_tokens.weight", TensorShard(0, (257, 32), 512, 1, 2))]
    for tensor, shard in shards:
        whole = full if tensor == name else embedding
        assert torch.equal(weights.read_local(tensor, shard, shard.global_shape), shard.local_slice(whole))
    with pytest.raises(ValueError, match=r"has shape \(64, 32\), the model built from its config \(32, 64\)"):
        weights.read_local(name, None, (32, 64))


def test_families_and_layouts_it_cannot_split_are_refused(family_dirs):
    with pytest.raises(ValueError, match=r"model_type='gpt2'.*no base_model_tp_plan.*GPT\.from_hf"):
        HFCausalLM(config={"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 4})
    with pytest.raises(ValueError, match=r"model_type='deepseek_v3'.*no mapping for.*'mla_kv_a_proj'"):
        HFCausalLM(config={"model_type": "deepseek_v3"})
    with pytest.raises(ValueError, match=r"needs its 'model_type'"):
        HFCausalLM(config={"hidden_size": 32})
    module = HFCausalLM(pretrained=family_dirs / "qwen3")
    for layout, refused in [(dict(tensor_parallel_size=2, sequence_parallel=True), "sequence_parallel"),
                            (dict(context_parallel_size=2), "context_parallel_size")]:
        with pytest.raises(ValueError, match=rf"{refused} is not available on this route"):
            module.validate_parallel_config(ParallelConfig(**layout))
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 does not divide \{'num_key_value_heads': 2\}"):
        module.validate_parallel_config(ParallelConfig(tensor_parallel_size=4))
    module.validate_parallel_config(ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2))
    assert set(TP_STYLES) >= {"colwise", "rowwise", "colwise_gather_output", "rowwise_split_input", "packed_colwise",
                              "embedding_rowwise", "replicated_with_grad_allreduce", "sequence_parallel"}


def test_a_config_alone_starts_as_transformers_initialises_it():
    """Matrices N(0, initializer_range), norm gains as their constructors set them (Gemma's (1 + w): zeros; Qwen3's:
    ones), the same values for the same seed; the hyper-parameters rebuild the module."""
    gains = {}
    for family in ("gemma3", "qwen3"):
        torch.manual_seed(SEED)
        module = HFCausalLM(config=FAMILIES[family])
        module.configure_model()
        params = dict(module.model.named_parameters())
        gains[family] = params["model.layers.0.input_layernorm.weight"]
        weight = params["model.layers.1.mlp.down_proj.weight"]
        assert abs(weight.std().item() - module.config.initializer_range) < 0.2 * module.config.initializer_range
        torch.manual_seed(SEED)
        again = HFCausalLM(**module.hparams)
        again.configure_model()
        assert again.config.to_dict() == module.config.to_dict()
        assert all(torch.equal(p, q) for p, q in zip(module.model.parameters(), again.model.parameters()))
    assert torch.equal(gains["gemma3"], torch.zeros(32)) and torch.equal(gains["qwen3"], torch.ones(32))
    assert read_config(FAMILIES["qwen3"]).head_dim == 16


@pytest.mark.parametrize("family", ["qwen3", "phi3"])
def test_lora_is_peft_on_transformers_projections(family, family_dirs, tmp_path):
    """LoRA's adapters land on transformers' own projections (Phi-3: one over its fused qkv_proj, as PEFT's), train
    alone, and give PEFT's logits with the same adapters; the export merges them, and transformers reads it back with
    the same logits."""
    peft = pytest.importorskip("peft")
    module = HFCausalLM.from_hf(family_dirs / family, lora={"rank": 4, "alpha": 8.0})
    trained = {name for name, param in module.model.named_parameters() if param.requires_grad}
    projections = {name.split(".")[-3] for name in trained}
    assert projections == ({"qkv_proj", "o_proj", "gate_up_proj", "down_proj"} if family == "phi3" else
                           {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"})
    assert all(".lora_a." in name or ".lora_b." in name for name in trained)
    with torch.no_grad():
        for name, param in module.model.named_parameters():
            if ".lora_b." in name:
                param.normal_(0.0, 0.05)
    reference = peft.get_peft_model(_reference_model(family_dirs / family), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=sorted(projections)))
    adapters = {f"base_model.model.{name}".replace("lora_a.weight", "lora_A.default.weight")
                .replace("lora_b.weight", "lora_B.default.weight"): param
                for name, param in module.model.named_parameters() if name in trained}
    assert not reference.load_state_dict(adapters, strict=False).unexpected_keys
    input_ids, _ = batches()[0]
    module.to_hf(tmp_path / "merged")
    with torch.no_grad():
        logits = module(input_ids)
        assert (reference(input_ids).logits - logits).abs().max() < 1e-5
        assert (_reference_model(tmp_path / "merged")(input_ids).logits - logits).abs().max() < 1e-4


def test_packed_sft_batches_train_each_conversation_as_transformers_sees_it_alone(family_dirs, tmp_path):
    """SFTDataModule's packed batches (the built-in instructions, byte tokens, prompts labelled -100, positions and
    document ids restarting per conversation) go in as they are: the loss is the sum of transformers' losses of each
    conversation alone over its response tokens (Gemma 3: sliding window, pad token)."""
    from types import SimpleNamespace

    from lightning_megatron.data import SFTDataModule

    module, reference = HFCausalLM.from_hf(family_dirs / "gemma3"), _reference_model(family_dirs / "gemma3")
    data = SFTDataModule(seq_length=48, global_batch_size=2, packing=True, split="1", index_cache_dir=str(tmp_path))
    data.trainer = SimpleNamespace(lightning_module=module, max_steps=-1, strategy=SimpleNamespace(
        distributed_sampler_kwargs={"num_replicas": 1, "rank": 0}))
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    assert batch["document_ids"].amax() > 0 and (batch["labels"] == -100).any()
    expected, counted = 0.0, 0
    with torch.no_grad():
        loss_sum, tokens = module.model.loss(batch["input_ids"], batch["labels"], position_ids=batch["position_ids"],
                                             document_ids=batch["document_ids"])
        for row in range(2):
            for document in batch["document_ids"][row].unique():
                keep = batch["document_ids"][row] == document
                labels = batch["labels"][row][keep]
                logits = reference(batch["input_ids"][row][keep][None]).logits[0]
                expected += F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum").item()
                counted += int((labels != -100).sum())
    assert int(tokens) == counted and abs(loss_sum.item() - expected) < 1e-5 * expected


# The layouts of the pooled job, 3 steps each: tp2 x dp2 with ZeRO 1-2 over the four families (Phi-3 and OLMo 2
# through the gathering styles; Gemma 3 with full recomputation of its layers), packed documents (2 steps), pp2 x dp2
# (Gemma 3's tied embedding on the first and last stage), pp2 x tp2, LoRA on every projection at tp2 x dp2 (Phi-3's
# adapters replicated beside its gathered layers). And Trainer.fit at tp2 x dp2 with ZeRO-3, resumed at pp2 x dp2
# (hf_causal_setup.FIT).
HF_LAYOUTS = ["qwen3-tp2-dp2-z1-s3", "phi3-tp2-dp2-z2-s3", "olmo2-tp2-dp2-s3", "gemma3-tp2-dp2-z2-rc-s3",
              "qwen3-doc-tp2-dp2-s2", "gemma3-pp2-tp1-dp2-mb2-s3", "phi3-pp2-tp2-dp1-mb2-s3",
              "qwen3-tp2-dp2-lora-s3", "phi3-tp2-dp2-z1-lora-s3"]


def _one_process(directory, steps, documents=False, lora=None):
    torch.manual_seed(SEED)
    module = HFCausalLM.from_hf(directory, lora=lora)
    model = module.model
    opt = optimizer([p for p in model.parameters() if p.requires_grad])
    losses = []
    for input_ids, labels, side in document_batches()[:steps] if documents else [(*b, {}) for b in batches()[:steps]]:
        loss_sum, tokens = model.loss(input_ids, labels, **side)
        (loss_sum / tokens).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append((loss_sum / tokens).item())
    return losses, {name: value.detach().clone() for name, value in model.state_dict().items()}


def _one_process_fit(directory):
    """The losses of FIT's steps in one process, and the weights after all but the last (where the pooled run saved
    its checkpoint)."""
    import lightning as L

    from workers.hf_causal_setup import FIT, fit_module
    from workers.trainer_setup import datamodule, trainer_kwargs

    class Record(L.Callback):
        losses, saved = [], {}

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.losses.append(outputs["loss"].item())
            if trainer.global_step == FIT["steps"] - 1:
                self.saved.update({k: v.detach().clone() for k, v in pl_module.state_dict().items()})

    L.seed_everything(FIT["seed"])
    module = fit_module(directory)
    L.Trainer(accelerator="cpu", devices=1, callbacks=[Record()], **trainer_kwargs(FIT)).fit(
        module, datamodule=datamodule(FIT))
    return Record.losses, Record.saved, module


def _close(result, reference, what):
    losses, weights = reference
    deviation = max(abs(a - b) for a, b in zip(result["losses"], losses, strict=True))
    assert deviation < 1e-5, (what, result["losses"], losses)
    assert result["weights"].keys() == weights.keys(), what
    worst = max((result["weights"][k] - weights[k]).abs().max().item() for k in weights)
    print(f"{what}: worst loss deviation {deviation:.1e}, worst weight deviation {worst:.1e}")
    assert worst < 1e-5, (what, worst)


@pytest.mark.slow
def test_layouts_give_one_process_and_transformers(family_dirs, tmp_path):
    """The core invariant for transformers' modules: every layout's losses and gathered weights are one process's
    (1e-5), and the first loss is transformers' own. Trainer.fit at tp2 x dp2 with ZeRO-3, then resumed from its
    sharded checkpoint at pp2 x dp2, gives one process's losses and (predict_step, every rank) logits; the checkpoint
    loads into one process with that process's weights, and the export is read by transformers' from_pretrained with
    the same logits."""
    run_job("hf_causal_layouts", 4, tmp_path, ",".join(HF_LAYOUTS + ["fit-qwen3"]), str(family_dirs))
    references = {}
    for layout in HF_LAYOUTS:
        family = layout.split("-")[0]
        if "-doc-" in layout:  # packed documents (position ids restarting, document ids): the worker's batches
            reference = _one_process(family_dirs / family, 2, documents=True)
        elif "-lora-" in layout:
            reference = _one_process(family_dirs / family, 3, lora=LORA)
        else:
            if family not in references:
                references[family] = _one_process(family_dirs / family, 3)
                input_ids, labels = batches()[0]
                with torch.no_grad():
                    logits = _reference_model(family_dirs / family)(input_ids).logits
                first = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100).item()
                assert abs(references[family][0][0] - first) < 1e-5
            reference = references[family]
        _close(torch.load(tmp_path / f"{layout}.pt", weights_only=True), reference, layout)

    losses, expected, fitted = _one_process_fit(family_dirs / "qwen3")
    summary = json.loads((tmp_path / "rank0.json").read_text())
    assert max(abs(a - b) for a, b in zip(summary["fit-qwen3"], losses, strict=True)) < 1e-5, (summary, losses)
    loaded = HFCausalLM.load_from_checkpoint(tmp_path / "fit.ckpt")
    assert loaded.state_dict().keys() == expected.keys()
    assert max((loaded.state_dict()[k] - expected[k]).abs().max().item() for k in expected) < 1e-5
    with torch.no_grad():
        logits = fitted(PREDICT_IDS)
    for rank in range(4):  # every rank of the resumed pp2 x dp2 run predicts the whole logits
        assert (torch.load(tmp_path / f"fit-logits{rank}.pt", weights_only=True) - logits).abs().max() < 1e-4
    exported = _reference_model(tmp_path / "exported")
    input_ids, _ = batches()[0]
    with torch.no_grad():
        assert (exported(input_ids).logits - loaded(input_ids)).abs().max() < 1e-4
