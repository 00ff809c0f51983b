"""Fine-tuning a Hugging Face model with LoRA: ``GPT(pretrained=...)``, adapter-only checkpoints, and the two exports
of ``lightning-megatron checkpoint convert`` (the merged model, a PEFT adapter). ``transformers`` and ``peft`` are the
oracles: tiny models built here with random weights, offline."""

import json
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
from lightning_megatron.checkpoint.open import open_checkpoint  # noqa: E402
from lightning_megatron.huggingface.checkpoints import convert  # noqa: E402
from lightning_megatron.checkpoint.replacement import INFO_FILE  # noqa: E402
from lightning_megatron.checkpoint.sharded import file_checksum  # noqa: E402
from lightning_megatron.cli import main as cli_main  # noqa: E402
from lightning_megatron.commands.generate import load_gpt  # noqa: E402
from lightning_megatron.huggingface.adapters import write_peft_adapter  # noqa: E402
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


# ----------------------------------------------------------------------------- the PEFT adapter, in memory
@pytest.mark.parametrize("family, targets", [
    ("llama", None),
    ("qwen2", None),
    ("mistral", None),
    ("gpt2", None),
    ("llama", ["blocks.1.attn.qkv", "*.mlp.fc"]),  # one layer's qkv only: PEFT gets full module names
])
def test_peft_loads_our_adapter_onto_the_hf_base_and_computes_our_lora_model(family, targets, tmp_path):
    base_dir = saved_base(tmp_path / "base", family)
    ours = GPT(pretrained=str(base_dir), lora={**LORA, **({"targets": targets} if targets else {})})
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
    if targets:
        assert "model.layers.1.self_attn.q_proj" in fields["target_modules"]
        assert "model.layers.0.self_attn.q_proj" not in fields["target_modules"]


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
