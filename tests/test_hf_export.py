"""Hugging Face exports in shards: save_pretrained's files and index, replacing our previous export cleanly;
``lightning-megatron checkpoint convert`` both ways for Llama, Mistral, Qwen2 and Gemma 3 (identical tensors); and an export of a
sharded training checkpoint that holds about one shard of weights in memory, never the whole model."""

import json
import subprocess
import sys
from dataclasses import asdict

import pytest
import torch

from launch import child_env
from workers.hf_llama_setup import MODEL_TYPES, build_hf_model, sample_input_ids
from lightning_megatron.checkpoint.sharded import save_sharded
from lightning_megatron.cli import main as cli_main
from lightning_megatron.huggingface.io import read_weights, shard_file_names
from lightning_megatron.huggingface.llama import hf_state_dict_from_llama
from lightning_megatron.huggingface.mapping import state_dict_shapes
from lightning_megatron.models import GPT, GPTConfig, GPTModel

transformers = pytest.importorskip("transformers")
INDEX = "model.safetensors.index.json"


def stored(hf) -> dict[str, torch.Tensor]:
    """What save_pretrained stores of ``hf``: its state dict without tied copies."""
    state = hf.state_dict()
    return {name: value for name, value in state.items()
            if not (name == "lm_head.weight" and hf.config.tie_word_embeddings)}


def test_sharded_export_loads_and_replaces_our_previous_export(tmp_path):
    hf = build_hf_model("qwen2")  # tied: lm_head.weight is not stored
    gpt = GPT.from_hf(hf)
    out = tmp_path / "hf"
    out.mkdir()
    (out / "tokenizer.json").write_text("{}")  # a tokenizer saved first is kept
    gpt.to_hf(out, max_shard_size="40KB")
    files = sorted(path.name for path in out.glob("model-*.safetensors"))
    assert len(files) > 2 and files == shard_file_names(len(files)) and not (out / "model.safetensors").exists()
    index = json.loads((out / INDEX).read_text())
    assert index["weight_map"].keys() == stored(hf).keys() and set(index["weight_map"].values()) == set(files)
    assert index["metadata"]["total_size"] == sum(value.numel() * 4 for value in stored(hf).values())
    reloaded = transformers.Qwen2ForCausalLM.from_pretrained(out).eval()
    assert all(torch.equal(reloaded.state_dict()[name], value) for name, value in hf.state_dict().items())

    gpt.to_hf(out)  # one file replaces the shards...
    assert {path.name for path in out.iterdir()} == {"config.json", "model.safetensors", "tokenizer.json"}
    gpt.to_hf(out, max_shard_size=60_000)  # ...and shards the file
    assert not (out / "model.safetensors").exists() and (out / INDEX).is_file()
    assert (out / "tokenizer.json").read_text() == "{}"
    with torch.no_grad():
        assert torch.equal(transformers.Qwen2ForCausalLM.from_pretrained(out).eval()(sample_input_ids()).logits,
                           hf(sample_input_ids()).logits)
    with pytest.raises(ValueError, match="max_shard_size='5 bananas' is not a size"):
        gpt.to_hf(out, max_shard_size="5 bananas")


@pytest.mark.parametrize("case", ["llama-gqa", "mistral", "qwen2", "gemma3"])
def test_checkpoint_convert_round_trips_to_identical_tensors(case, tmp_path):
    hf = build_hf_model(case)
    hf.save_pretrained(tmp_path / "hf")
    cli_main(["checkpoint", "convert", str(tmp_path / "hf"), str(tmp_path / "ours.ckpt")])
    # Mistral only when asked for; the others follow from the config (Gemma 3's named too: every family is a choice)
    choice = ["--model-type", MODEL_TYPES[case]] if case in ("mistral", "gemma3") else []
    cli_main(["checkpoint", "convert", str(tmp_path / "ours.ckpt"), str(tmp_path / "back"), "--max-shard-size", "40KB",
              *choice])
    assert json.loads((tmp_path / "back" / "config.json").read_text())["model_type"] == MODEL_TYPES[case]
    assert (tmp_path / "back" / INDEX).is_file()
    original, back = read_weights(tmp_path / "hf"), read_weights(tmp_path / "back")
    assert back.keys() == original.keys()
    assert all(torch.equal(back[name], value) for name, value in original.items())
    reloaded = type(hf).from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        assert torch.equal(reloaded(sample_input_ids()).logits, hf(sample_input_ids()).logits)


# Peak RSS of the conversion alone: Linux's high-water mark (VmHWM), reset to the current RSS once the imports
# (whose own transient peak is larger than this export's) are done.
MEASURE = """
import json, re, sys
from lightning_megatron.huggingface.checkpoints import convert

def kilobytes(field):
    return int(re.search(field + r":\\s+(\\d+) kB", open("/proc/self/status").read())[1])

open("/proc/self/clear_refs", "w").write("5")
before = kilobytes("VmRSS")
convert(sys.argv[1], sys.argv[2], max_shard_size=sys.argv[3])
print(json.dumps({"peak_growth": (kilobytes("VmHWM") - before) * 1024}))
"""


@pytest.mark.slow
def test_export_of_a_sharded_checkpoint_holds_about_one_shard(tmp_path):
    """A ~150 MiB model in 8 MB shards (no tensor larger): the export's peak RSS grows by about two shards (the
    shard's tensors and safetensors' serialised copy) and a fixed ~10 MiB, never by the model (measured: ~22 MiB;
    the whole model as one shard: ~165 MiB)."""
    config = GPTConfig.from_name("llama-tiny", vocab_size=4096, hidden_size=512, num_heads=8, num_query_groups=2,
                                 num_layers=12, ffn_hidden_size=1536)
    generator = torch.Generator().manual_seed(0)
    state = {name: torch.randn(shape, generator=generator) for name, shape in state_dict_shapes(GPTModel, config).items()}
    model_bytes = sum(value.numel() * value.element_size() for value in state.values())
    save_sharded(tmp_path / "last.ckpt", {f"state_dict/model.{name}": value for name, value in state.items()},
                 {"hyper_parameters": {"config": asdict(config)}}, {"model": "lightning_megatron.models.GPT"})
    shard = 8 * 10**6
    # a fixed mmap threshold: freed buffers go back to the OS at once, so RSS counts what is held, not malloc's cache
    run = subprocess.run([sys.executable, "-c", MEASURE, str(tmp_path / "last.ckpt"), str(tmp_path / "hf"), str(shard)],
                         env=child_env(MALLOC_MMAP_THRESHOLD_="131072"), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    growth = json.loads(run.stdout.strip().splitlines()[-1])["peak_growth"]
    files = sorted(path.name for path in (tmp_path / "hf").glob("model-*.safetensors"))
    print(f"model {model_bytes / 2**20:.0f} MiB in {len(files)} shards of at most {shard / 2**20:.1f} MiB: "
          f"peak RSS grew by {growth / 2**20:.1f} MiB")
    assert len(files) >= model_bytes // shard
    assert growth < min(4 * shard + 16 * 2**20, model_bytes / 3)

    exported = read_weights(tmp_path / "hf")
    expected = hf_state_dict_from_llama(state, config)
    assert exported.keys() == expected.keys() and all(torch.equal(exported[name], expected[name]) for name in expected)
