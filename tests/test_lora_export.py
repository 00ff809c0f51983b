"""Fine-tuning a Hugging Face model with LoRA: ``GPT(pretrained=...)``, adapter-only checkpoints, and the two exports
of ``lightning-megatron checkpoint convert`` (the merged model, a PEFT adapter). ``transformers`` and ``peft`` are the
oracles: tiny models built here with random weights, offline."""

import json
import re
import shutil
from dataclasses import asdict, replace

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from launch import run_job  # noqa: E402
from workers.trainer_setup import datamodule, model, trainer_kwargs  # noqa: E402
from lightning_megatron import Megatron3DStrategy  # noqa: E402
from lightning_megatron.checkpoint.base import load_adapters  # noqa: E402
from lightning_megatron.checkpoint.open import open_checkpoint  # noqa: E402
from lightning_megatron.huggingface.checkpoints import convert  # noqa: E402
from lightning_megatron.checkpoint.replacement import INFO_FILE  # noqa: E402
from lightning_megatron.checkpoint.sharded import file_checksum  # noqa: E402
from lightning_megatron.cli import main as cli_main  # noqa: E402
from lightning_megatron.commands.generate import load_gpt  # noqa: E402
from lightning_megatron.huggingface.adapters import peft_adapter, read_peft_adapter, write_peft_adapter  # noqa: E402
from lightning_megatron.models import GPT, GPTConfig  # noqa: E402
from lightning_megatron.parallel.names import is_adapter_name  # noqa: E402
from lightning_megatron.plan.inventory import Inventory  # noqa: E402

LORA = {"rank": 4, "alpha": 8.0}
TOKENS = torch.randint(0, 257, (2, 12), generator=torch.Generator().manual_seed(5))


def hf_model(family: str, seed: int = 0):
    """A tiny ``transformers`` model of ``family`` with random weights (vocabulary: our byte tokenizer's)."""
    torch.manual_seed(seed)
    if family == "gpt2":
        config = transformers.GPT2Config(vocab_size=257, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return transformers.GPT2LMHeadModel(config).eval()
    sizes = dict(vocab_size=257, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64)
    if family == "qwen2":  # biases on q, k and v
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**sizes)).eval()
    if family == "qwen3":  # q/k norms, heads wider than hidden / heads (random gains: the norms count)
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**sizes, head_dim=16)).eval()
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.uniform_(0.5, 1.5)
        return model
    if family == "gemma3":  # four norms a layer, windows and rotary bases per layer type, soft-capped logits
        config = transformers.Gemma3TextConfig(**sizes, head_dim=16, query_pre_attn_scalar=12, sliding_window=4,
                                               final_logit_softcapping=3.0, pad_token_id=None,
                                               layer_types=["sliding_attention", "full_attention"])
        model = transformers.Gemma3ForCausalLM(config).eval()
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.uniform_(-0.5, 0.5)
        return model
    if family == "mistral":
        return transformers.MistralForCausalLM(transformers.MistralConfig(**sizes, sliding_window=None)).eval()
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**sizes)).eval()


def saved_base(directory, family: str = "llama", seed: int = 0):
    hf_model(family, seed).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return saved_base(tmp_path_factory.mktemp("llama"))


def logits_of(model, tokens=TOKENS) -> torch.Tensor:
    with torch.no_grad():
        out = model(tokens)
    return (out.logits if hasattr(out, "logits") else out).float()[..., :257]  # a trained model's vocab is padded


def test_to_hf_of_a_lora_module_writes_the_model_with_its_adapters_merged(llama_dir, tmp_path):
    """``GPT.to_hf`` of a module carrying adapters (per projection, some left out) writes the merged model, which
    transformers computes as our adapted module does."""
    module = GPT(pretrained=str(llama_dir), lora={**LORA, "targets": ["*.attn.qkv.q", "*.attn.qkv.v", "*.mlp.fc",
                                                                          "*.attn.proj"]})
    module.configure_model()
    torch.manual_seed(2)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if ".lora_b." in name:
                param.normal_(std=0.1)  # B != 0: the merge shows
    module.to_hf(tmp_path / "merged")
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    torch.testing.assert_close(logits_of(merged), logits_of(module.eval()), atol=1e-4, rtol=0)
    assert not torch.allclose(logits_of(merged), logits_of(hf_model("llama")), atol=1e-3)


# ----------------------------------------------------------------------------- the PEFT adapter, in memory
@pytest.mark.parametrize("family, settings", [
    ("llama", {}),
    ("qwen2", {}),
    ("qwen3", {}),
    ("gemma3", {}),
    ("mistral", {}),
    ("gpt2", {}),
    ("llama", {"targets": ["blocks.1.attn.qkv", "*.mlp.fc"]}),  # one layer's qkv only: PEFT gets full module names
    ("llama", {"targets": ["*.attn.qkv.q", "*.attn.qkv.v", "*.mlp.fc.up", "*.attn.proj"]}),  # some projections
    ("llama", {"variant": "fused"}),  # one A shared by q, k and v (and by gate and up): written to each module
])
def test_peft_loads_our_adapter_onto_the_hf_base_and_computes_our_lora_model(family, settings, tmp_path):
    base_dir = saved_base(tmp_path / "base", family)
    targets = settings.get("targets")
    ours = GPT(pretrained=str(base_dir), lora={**LORA, **settings})
    ours.configure_model()
    with torch.no_grad():  # B starts at zero: random adapters make every part of the mapping count
        for name, param in ours.model.named_parameters():
            if is_adapter_name(name):
                param.normal_(0.0, 0.2)
    adapters = {name: param.detach() for name, param in ours.model.named_parameters() if is_adapter_name(name)}
    write_peft_adapter(tmp_path / "adapter", ours.config, adapters, ours.lora, base_model=str(base_dir))
    fields = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (fields["peft_type"], fields["r"], fields["lora_alpha"]) == ("LORA", 4, 8.0)

    base = type(hf_model(family)).from_pretrained(base_dir).eval()
    expected_base = logits_of(base)
    adapted = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    got, expected = logits_of(ours.model), logits_of(adapted)
    assert (got - expected_base).abs().max() > 1e-2  # the adapters change the logits ...
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)  # ... as peft's adapters do
    if targets and targets[0] == "blocks.1.attn.qkv":
        assert "model.layers.1.self_attn.q_proj" in fields["target_modules"]
        assert "model.layers.0.self_attn.q_proj" not in fields["target_modules"]
    elif targets:
        assert fields["target_modules"] == ["o_proj", "q_proj", "up_proj", "v_proj"]


# ----------------------------------------------------------------------------- PEFT's own LoRA, step for step
PEFT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _train(model, parameters, batches):
    """A plain torch loop: next-token cross-entropy, AdamW; the losses of each step."""
    optimizer = torch.optim.AdamW(parameters, lr=1e-2, weight_decay=0.1)
    losses = []
    for ids in batches:
        out = model(ids)
        logits = out.logits if hasattr(out, "logits") else out
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("variant", ["canonical", "fused"])
def test_lora_trains_as_transformers_and_peft_do(variant):
    """The default LoRA is PEFT's: a GQA Llama (4 heads, 2 key/value heads) with PEFT's adapters on every linear
    layer, trained by the same loop from the same adapters, gives the same losses and adapters at every step, with
    as many trained numbers. ``variant="fused"`` is PEFT's model with one ``A`` tied across q, k, v and across
    gate, up: the shared-A LoRA this package trained before, and fewer numbers."""
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config)
    ours = GPT.from_hf(hf, lora={"rank": 8, "alpha": 16.0, "variant": variant})
    theirs = peft.get_peft_model(hf, peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                                      target_modules=PEFT_TARGETS))
    if variant == "fused":
        for layer in theirs.base_model.model.model.layers:
            attention, mlp = layer.self_attn, layer.mlp
            attention.k_proj.lora_A.default.weight = attention.v_proj.lora_A.default.weight = \
                attention.q_proj.lora_A.default.weight
            mlp.up_proj.lora_A.default.weight = mlp.gate_proj.lora_A.default.weight
    adapters = lambda: {n: p for n, p in ours.model.named_parameters() if is_adapter_name(n)}  # noqa: E731
    peft.set_peft_model_state_dict(theirs, peft_adapter(ours.config, adapters())[0])  # ours' start, B zero
    trained = [p for p in theirs.parameters() if p.requires_grad]
    numbers = sum(p.numel() for p in adapters().values())
    assert numbers == sum(p.numel() for p in trained)
    # r (in + out) per adapter and layer: fused qkv 64 + 128, o 64 + 64, [gate | up] 64 + 192, down 96 + 64.
    assert numbers == (theirs.get_nb_trainable_parameters()[0] if variant == "canonical" else
                       2 * 8 * (192 + 128 + 256 + 160))
    batches = [torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(step % 2)) for step in range(6)]
    expected = _train(theirs, trained, batches)
    got = _train(ours.model, list(adapters().values()), batches)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), atol=1e-4, rtol=0)
    assert expected[-1] < expected[0] - 0.05  # it trains
    theirs_now = peft.get_peft_model_state_dict(theirs)
    for name, value in peft_adapter(ours.config, {n: p.detach() for n, p in adapters().items()})[0].items():
        torch.testing.assert_close(value, theirs_now[name], atol=1e-4, rtol=0)


def peft_adapter_dir(directory, family: str, base_dir, target_modules, seed: int = 3):
    """A PEFT adapter directory made by ``peft`` itself on ``family``'s base, B as random as A."""
    torch.manual_seed(seed)
    base = type(hf_model(family)).from_pretrained(base_dir)
    adapted = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=target_modules,
                                                        fan_in_fan_out=family == "gpt2", lora_dropout=0.0))
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.2)
    adapted.save_pretrained(directory)
    return adapted.eval()


@pytest.mark.parametrize("family, target_modules", [("llama", ["q_proj", "v_proj", "down_proj", "up_proj"]),
                                                    ("gpt2", ["c_attn", "c_proj", "c_fc"])])
def test_a_peft_adapter_directory_loads_as_peft_computes_it_and_exports_back_exactly(family, target_modules,
                                                                                      tmp_path):
    base_dir = saved_base(tmp_path / "base", family)
    theirs = peft_adapter_dir(tmp_path / "peft", family, base_dir, target_modules)
    ours = GPT(pretrained=str(base_dir), lora=str(tmp_path / "peft"))
    ours.configure_model()
    assert ours.lora.variant == "canonical" and ours.hparams["lora"] == ours.lora.as_dict()
    torch.testing.assert_close(logits_of(ours.model), logits_of(theirs), atol=1e-4, rtol=0)
    adapters = {name: param.detach() for name, param in ours.model.named_parameters() if is_adapter_name(name)}
    write_peft_adapter(tmp_path / "again", ours.config, adapters, ours.lora)
    load = peft.utils.save_and_load.safe_load_file
    written, original = load(tmp_path / "again" / "adapter_model.safetensors"), load(tmp_path / "peft" /
                                                                                      "adapter_model.safetensors")
    assert written.keys() == original.keys()
    assert all(torch.equal(written[name], original[name]) for name in original)
    fields = json.loads((tmp_path / "again" / "adapter_config.json").read_text())
    assert sorted(fields["target_modules"]) == sorted(target_modules)
    # ours -> PEFT -> ours is exact too
    lora, back = read_peft_adapter(tmp_path / "again", ours.config)
    assert lora == ours.lora and back.keys() == adapters.keys()
    assert all(torch.equal(back[name], adapters[name]) for name in adapters)


def test_what_our_lora_does_not_compute_is_refused_by_name(llama_dir, tmp_path):
    peft_adapter_dir(tmp_path / "peft", "llama", llama_dir, ["q_proj", "o_proj"])
    for field, value in [("use_dora", True), ("use_rslora", True), ("bias", "all"), ("modules_to_save", ["lm_head"]),
                         ("rank_pattern", {"q_proj": 8}), ("layers_to_transform", [0])]:
        changed = tmp_path / field
        shutil.copytree(tmp_path / "peft", changed)
        fields = json.loads((changed / "adapter_config.json").read_text())
        (changed / "adapter_config.json").write_text(json.dumps({**fields, field: value}))
        with pytest.raises(ValueError, match=re.escape(f"{field}={value!r}") + ".*merge_and_unload"):
            GPT(pretrained=str(llama_dir), lora=str(changed))
    other = saved_base(tmp_path / "other", "qwen2")  # another model's directory, recorded as the adapter's base
    fields = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    (tmp_path / "peft" / "adapter_config.json").write_text(json.dumps({**fields, "base_model_name_or_path": str(other)}))
    with pytest.raises(ValueError, match=r"was trained on .*other.*load it onto pretrained="):
        GPT(pretrained=str(llama_dir), lora=str(tmp_path / "peft"))
    with pytest.raises(ValueError, match=r"is a PEFT adapter directory, which adapts a base model: give pretrained="):
        GPT(GPT(pretrained=str(llama_dir)).config, lora=str(tmp_path / "peft"))
    (tmp_path / "pickled").mkdir()
    shutil.copy(tmp_path / "peft" / "adapter_config.json", tmp_path / "pickled")
    (tmp_path / "pickled" / "adapter_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"is not a PEFT adapter directory.*pickled adapter_model.bin files are not"):
        GPT(pretrained=str(llama_dir), lora=str(tmp_path / "pickled"))
    with pytest.raises(ValueError, match=r"LoRA variant must be one of \['canonical', 'fused'\]"):
        GPT(pretrained=str(llama_dir), lora={"variant": "shared"})


def test_adapters_saved_before_the_per_projection_default_name_the_fused_variant(llama_dir):
    fused = GPT(pretrained=str(llama_dir), lora={**LORA, "variant": "fused"})
    fused.configure_model()
    saved = {name: value for name, value in fused.state_dict().items() if is_adapter_name(name)}
    canonical = GPT(pretrained=str(llama_dir), lora=LORA)
    canonical.configure_model()
    with pytest.raises(RuntimeError, match=r"one adapter over each fused layer .*variant: fused"):
        load_adapters(canonical, saved)
    load_adapters(fused, saved)


@pytest.mark.slow
def test_a_config_that_disagrees_with_the_pretrained_directory_is_refused(llama_dir):
    with pytest.raises(ValueError, match=r"hidden_size=64 \(the directory's: 32\)"):
        GPT(GPTConfig.from_name("llama-tiny"), pretrained=str(llama_dir)).configure_model()  # checked when read
    # A preset's name (a config file's ``config: llama-tiny``) gives way to the directory's own config.
    assert GPT("llama-tiny", pretrained=str(llama_dir)).config == GPT(pretrained=str(llama_dir)).config
    same = GPT(GPT(pretrained=str(llama_dir)).config, pretrained=str(llama_dir))
    assert same.hparams["pretrained"] == str(llama_dir)


# ----------------------------------------------------------------------------- a LoRA run and its checkpoints
class Losses(Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


def lora_module(base_dir) -> GPT:
    return GPT(pretrained=str(base_dir), lora=LORA, learning_rate=1e-2, warmup_steps=1, adam_eps=1e-6)


def fit(module, root, steps, *, ckpt_path=None, checkpoint_format="sharded", save_every=None):
    L.seed_everything(7)
    losses = Losses()
    saving = [ModelCheckpoint(dirpath=root, every_n_train_steps=save_every, save_top_k=-1)] if save_every else []
    trainer = L.Trainer(accelerator="cpu", devices=1, default_root_dir=root, callbacks=[losses, *saving],
                        strategy=Megatron3DStrategy(checkpoint_format=checkpoint_format),
                        **{**trainer_kwargs({"steps": steps}), "limit_val_batches": 0,
                           "enable_checkpointing": bool(save_every)})
    trainer.fit(module, datamodule=datamodule({}), ckpt_path=ckpt_path)
    return trainer, losses.losses


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, llama_dir):
    """Four steps of LoRA on the Llama base (a checkpoint after two), saved both ways; the module as trained."""
    root = tmp_path_factory.mktemp("lora_run")
    module = lora_module(llama_dir)
    trainer, losses = fit(module, root, 4, save_every=2)
    trainer.save_checkpoint(root / "sharded.ckpt")
    trainer.strategy.options = replace(trainer.strategy.options, checkpoint_format="full")
    trainer.save_checkpoint(root / "full.ckpt")
    return root, module, losses


@pytest.mark.slow
def test_an_adapter_checkpoint_holds_the_adapters_and_their_optimizer_state_and_a_reference_to_the_base(
        lora_run, llama_dir, capsys):
    root, module, _ = lora_run
    adapters = {name for name, _ in module.named_parameters() if is_adapter_name(name)}
    base_bytes = sum(p.numel() * p.element_size() for n, p in module.named_parameters() if not is_adapter_name(n))
    adapter_bytes = sum(p.numel() * p.element_size() for n, p in module.named_parameters() if is_adapter_name(n))
    for name in ("sharded.ckpt", "full.ckpt"):
        saved = open_checkpoint(root / name)
        weights = {key.removeprefix("state_dict/") for key in saved.specs if key.startswith("state_dict/")}
        assert weights == adapters
        state = {key.split("/")[2] for key in saved.specs if key.startswith("optimizer/")}  # full: by position
        assert len(state) == len(adapters) and (name == "full.ckpt" or state == adapters)
        tensor_bytes = sum(spec.numel() * spec.element_size() for spec in saved.specs.values())
        assert tensor_bytes < 3 * adapter_bytes + 1024 < base_bytes, (name, tensor_bytes, adapter_bytes, base_bytes)
        reference = saved.trainer_state()["megatron_3d_base"]
        assert reference["pretrained"] == str(llama_dir.resolve())
        assert set(reference["fingerprint"]["weights"]) == {"model.safetensors"}
        cli_main(["checkpoint", "inspect", str(root / name)])
        assert f"base         {llama_dir.resolve()} (adapter-only" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sharded.ckpt", "full.ckpt"])
def test_load_from_checkpoint_and_generate_rebuild_the_trained_model_from_the_base_and_the_adapters(lora_run, name):
    root, module, _ = lora_run
    expected = logits_of(module.model.cpu())
    assert (expected - logits_of(hf_model("llama"))).abs().max() > 1e-3  # two steps moved the adapters
    torch.testing.assert_close(logits_of(GPT.load_from_checkpoint(root / name).model), expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(logits_of(load_gpt(root / name).model), expected, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_the_merged_export_and_the_peft_adapter_compute_the_trained_model_in_transformers(lora_run, llama_dir,
                                                                                            tmp_path, capsys):
    root, module, _ = lora_run
    expected = logits_of(module.model.cpu())
    cli_main(["checkpoint", "convert", str(root / "sharded.ckpt"), str(tmp_path / "merged")])
    cli_main(["checkpoint", "convert", str(root / "sharded.ckpt"), str(tmp_path / "adapter"), "--peft"])
    assert "LoRA adapters merged" in capsys.readouterr().out
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    base = transformers.AutoModelForCausalLM.from_pretrained(llama_dir)
    peft_merged = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").merge_and_unload().eval()
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] == \
        str(llama_dir.resolve())
    torch.testing.assert_close(logits_of(merged), logits_of(peft_merged), atol=1e-4, rtol=0)
    torch.testing.assert_close(logits_of(merged), expected, atol=1e-4, rtol=0)
    convert(root / "full.ckpt", tmp_path / "merged_from_full")  # the single-file format exports the same model
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged_from_full").eval()
    torch.testing.assert_close(logits_of(again), logits_of(merged), atol=0, rtol=0)


def test_a_lora_run_without_a_pretrained_base_stores_the_base_and_exports_it_merged(tmp_path):
    module = GPT({"vocab_size": 257, "max_seq_length": 32, "hidden_size": 32, "num_layers": 2, "num_heads": 4,
                  "normalization": "RMSNorm", "position_embedding_type": "rope", "activation": "swiglu",
                  "add_bias_linear": False, "tie_embeddings": False, "ffn_hidden_size": 48},
                 lora=LORA, learning_rate=1e-2, warmup_steps=1)
    trainer, _ = fit(module, tmp_path, 1)
    trainer.save_checkpoint(tmp_path / "all.ckpt")
    saved = open_checkpoint(tmp_path / "all.ckpt")
    assert "state_dict/model.blocks.0.attn.qkv.weight" in saved.specs
    assert "megatron_3d_base" not in saved.trainer_state()
    convert(tmp_path / "all.ckpt", tmp_path / "merged")
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    torch.testing.assert_close(logits_of(merged), logits_of(module.model.cpu()), atol=1e-4, rtol=0)


@pytest.mark.slow
def test_resuming_an_adapter_checkpoint_continues_the_uninterrupted_run(lora_run, llama_dir, tmp_path):
    root, uninterrupted, losses = lora_run
    resumed = lora_module(llama_dir)
    _, last_two = fit(resumed, tmp_path, 4, ckpt_path=root / "epoch=0-step=2.ckpt")
    torch.testing.assert_close(torch.tensor(last_two), torch.tensor(losses[2:]), atol=1e-5, rtol=0)
    for (name, got), expected in zip(resumed.named_parameters(), uninterrupted.parameters()):
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=0, msg=name)


@pytest.mark.slow
def test_lora_on_a_pretrained_base_at_tp2_pp2_equals_one_process_and_its_checkpoint_resumes_in_one(
        llama_dir, tmp_path):
    """The base read by every rank and cut into its shards, the adapters given the start one process gives them:
    the same losses; the adapter-only checkpoint saved by 4 ranks after step 2 resumes in one process."""
    options = {"tp": 2, "pp": 2, "steps": 4, "micro_batch_size": 2, "save_at_step": 2, "lora": LORA,
               "pretrained": str(llama_dir)}
    results, _ = run_job("trainer_fit", 4, tmp_path / "tp2pp2", json.dumps(options))
    _, one = fit(model(options), tmp_path / "one", 4)
    per_rank = torch.tensor([result["losses"] for result in results])
    assert (per_rank == per_rank[0]).all()
    torch.testing.assert_close(per_rank[0], torch.tensor(one), atol=1e-5, rtol=0)
    saved = open_checkpoint(tmp_path / "tp2pp2" / "step2.ckpt")
    assert all(is_adapter_name(key) for key in saved.specs if key.startswith("state_dict/"))
    _, resumed = fit(model(options), tmp_path / "resumed", 4, ckpt_path=tmp_path / "tp2pp2" / "step2.ckpt")
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(one[2:]), atol=1e-5, rtol=0)


@pytest.mark.slow
def test_a_peft_adapter_continues_training_at_tp2_as_in_one_process(llama_dir, tmp_path):
    """Adapters made by peft, read by every rank and cut into its shards (not drawn from the seed): the same losses
    as one process, which starts from the logits peft computes (the test above)."""
    peft_adapter_dir(tmp_path / "peft", "llama", llama_dir, PEFT_TARGETS)
    options = {"tp": 2, "sp": True, "steps": 3, "micro_batch_size": 2, "lora": str(tmp_path / "peft"),
               "pretrained": str(llama_dir)}
    results, _ = run_job("trainer_fit", 2, tmp_path / "tp2", json.dumps(options))
    trainer, one = fit(model(options), tmp_path / "one", 3)
    per_rank = torch.tensor([result["losses"] for result in results])
    assert (per_rank == per_rank[0]).all()
    torch.testing.assert_close(per_rank[0], torch.tensor(one), atol=1e-5, rtol=0)
    _, seeded = fit(model({**options, "lora": trainer.lightning_module.lora.as_dict()}), tmp_path / "seeded", 1)
    assert abs(seeded[0] - one[0]) > 1e-3  # peft's adapters, not the seeded start (B = 0: the base's loss)


@pytest.mark.slow
def test_a_changed_base_is_refused_by_every_reader_naming_both(lora_run, llama_dir, tmp_path):
    root, _, _ = lora_run
    moved = tmp_path / "base"
    shutil.copytree(llama_dir, moved)
    checkpoint = tmp_path / "adapters.ckpt"
    shutil.copytree(root / "sharded.ckpt", checkpoint)
    state_file = checkpoint / "trainer_state.pt"
    state = torch.load(state_file, weights_only=True)
    state["megatron_3d_base"]["pretrained"] = str(moved)  # a checkpoint of a run on the copy, with its fingerprint
    state["hyper_parameters"]["pretrained"] = str(moved)
    torch.save(state, state_file)
    info_file = checkpoint / INFO_FILE  # the checksum that run's save would have recorded
    info = json.loads(info_file.read_text())
    info["checksums"]["files"][state_file.name] = {"crc32": file_checksum(state_file),
                                                   "bytes": state_file.stat().st_size}
    info_file.write_text(json.dumps(info))
    GPT.load_from_checkpoint(checkpoint)  # the copy is the same base
    saved_base(moved, seed=1)  # other weights of the same shapes under the same path
    message = rf"trained on the base {moved}, but the base at {moved} is another model now"
    with pytest.raises(RuntimeError, match=message):
        GPT.load_from_checkpoint(checkpoint)
    with pytest.raises(RuntimeError, match=message):
        convert(checkpoint, tmp_path / "merged")
    assert not (tmp_path / "merged").exists()
    with pytest.raises(RuntimeError, match=message):
        fit(GPT(pretrained=str(moved), lora=LORA), tmp_path / "resume", 3, ckpt_path=checkpoint)
    with pytest.raises(RuntimeError, match="has no pretrained base: build it with pretrained="):
        fit(GPT(GPT(pretrained=str(moved)).config, lora=LORA), tmp_path / "resume2", 3, ckpt_path=checkpoint)


# ----------------------------------------------------------------------------- the pretrained base's config
@pytest.mark.slow
def test_a_given_config_is_checked_against_the_base_when_its_weights_are_read_and_plans_without_them(llama_dir,
                                                                                                   tmp_path,
                                                                                                   no_process_group):
    """A config file may name its base: ``GPT(config, pretrained)`` reads nothing when made, so the planner plans
    the config's shapes where the weights are not (here: a directory that does not exist); the weights' read checks
    the config against the base's and names the fields that differ."""
    config = GPT(pretrained=str(llama_dir)).config  # config.json only
    inventory = Inventory.build(lambda: GPT(asdict(config), pretrained=str(tmp_path / "not-there"), lora={"rank": 4}),
                                tensor_parallel_size=2)
    frozen, adapters = ([e.names[0] for e in inventory.entries if e.requires_grad is trainable]
                        for trainable in (False, True))
    assert frozen and adapters and all(".lora_" in name for name in adapters)

    other = GPT({**config.__dict__, "ffn_hidden_size": 64}, pretrained=str(llama_dir))
    with pytest.raises(ValueError, match=r"describes another model than the one there: ffn_hidden_size=64 \(the "
                                         r"directory's: 48\)"):
        other.configure_model()
    same = GPT({**config.__dict__, "dropout": 0.1}, pretrained=str(llama_dir))  # how it trains may differ
    same.configure_model()
    torch.testing.assert_close(same.model.blocks["0"].attn.proj.weight,
                               GPT.from_hf(str(llama_dir)).model.blocks["0"].attn.proj.weight)
