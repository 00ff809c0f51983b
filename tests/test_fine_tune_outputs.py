"""What a new user does with a fine-tune of a Hugging Face chat model (a tiny Llama with a BPE tokenizer and a chat
template, made here offline): ``lightning-megatron generate --prompt-style chat`` on the training checkpoint (the
tokenizer of the base it records, or the one given as a directory or a tokenizer.json), and the Hugging Face export,
which ``transformers`` (``AutoTokenizer``, ``AutoModelForCausalLM``, ``generate``) and our ``generate`` use as is.
Both a full fine-tune and a LoRA run's merged export; the oracles are ``transformers`` and the trained module."""

import json
import shutil
import sys
from pathlib import Path

import lightning as L
import pytest
import torch

transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).parent / "workers"))

import hf_chat_setup  # noqa: E402
from workers.trainer_setup import datamodule, trainer_kwargs  # noqa: E402
from lightning_megatron import Megatron3DStrategy  # noqa: E402
from lightning_megatron.huggingface.checkpoints import convert  # noqa: E402
from lightning_megatron.commands.generate import main as generate_main  # noqa: E402
from lightning_megatron.huggingface.companions import TOKENIZER_FILES  # noqa: E402
from lightning_megatron.models import GPT  # noqa: E402

PROMPT = "hello world"
NEW_TOKENS = 6
RUNS = {"full": {}, "lora": {"lora": {"rank": 4, "alpha": 8.0}}}


@pytest.fixture(scope="module")
def fine_tunes(tmp_path_factory):
    """The base directory, and per run kind the trained module and its sharded checkpoint (two steps each)."""
    root = tmp_path_factory.mktemp("fine_tunes")
    base = hf_chat_setup.save_chat_llama(root / "base")
    runs = {}
    for name, kwargs in RUNS.items():
        module = GPT(pretrained=str(base), learning_rate=2e-2, warmup_steps=1, **kwargs)
        L.seed_everything(7)
        trainer = L.Trainer(accelerator="cpu", devices=1, default_root_dir=root, strategy=Megatron3DStrategy(),
                            **{**trainer_kwargs({"steps": 2}), "limit_val_batches": 0})
        trainer.fit(module, datamodule=datamodule({}))
        trainer.save_checkpoint(root / f"{name}.ckpt")
        runs[name] = (module.cpu().eval(), root / f"{name}.ckpt")
    return base, runs


def chat_ids(tokenizer) -> list[int]:
    return list(tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=True,
                                              add_generation_prompt=True, return_dict=False))


def expected_answer(module, base) -> str:
    """What the trained module answers, greedy, to the prompt written with the base tokenizer's chat template."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(base)
    ids = chat_ids(tokenizer)
    out = module.generate([ids], max_new_tokens=NEW_TOKENS, eos_id=tokenizer.eos_token_id)[0]
    return tokenizer.decode(out[len(ids):], skip_special_tokens=True)


def generated(capsys, *args) -> str:
    """The answer ``lightning-megatron generate --prompt-style chat`` prints (the text after the prompt's line)."""
    capsys.readouterr()
    generate_main(["--prompt", PROMPT, "--prompt-style", "chat", "--max-new-tokens", str(NEW_TOKENS), *args])
    printed = capsys.readouterr().out.split("\n" + "-" * 40)[0]
    assert printed.startswith(PROMPT + "\n"), printed
    return printed[len(PROMPT) + 1:]


def refusal(capsys, *args) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit):
        generate_main(["--prompt", PROMPT, "--max-new-tokens", "2", *args])
    return capsys.readouterr().err.splitlines()[-1]


@pytest.mark.slow
@pytest.mark.parametrize("run", list(RUNS))
def test_generate_on_a_training_checkpoint_uses_the_tokenizer_and_chat_template_of_its_base(fine_tunes, run, capsys,
                                                                                            tmp_path):
    base, runs = fine_tunes
    module, checkpoint = runs[run]
    expected = expected_answer(module, base)
    assert generated(capsys, "--checkpoint", str(checkpoint)) == expected  # the base's, by default
    assert generated(capsys, "--checkpoint", str(checkpoint), "--tokenizer", str(base)) == expected
    # a tokenizer.json stands for the tokenizer directory it lies in (its chat template)
    assert generated(capsys, "--checkpoint", str(checkpoint), "--tokenizer", str(base / "tokenizer.json")) == expected

    (tmp_path / "bare").mkdir()
    shutil.copy(base / "tokenizer.json", tmp_path / "bare")
    message = refusal(capsys, "--checkpoint", str(checkpoint), "--prompt-style", "chat",
                      "--tokenizer", str(tmp_path / "bare" / "tokenizer.json"))
    assert "no tokenizer_config.json beside it" in message and "--prompt-style plain" in message
    assert "no such file or directory" in refusal(capsys, "--checkpoint", str(checkpoint),
                                                  "--tokenizer", str(tmp_path / "missing"))
    assert "the byte tokenizer has none" in refusal(capsys, "--checkpoint", str(checkpoint), "--prompt-style", "chat",
                                                    "--tokenizer", "byte")


@pytest.mark.slow
def test_a_base_without_a_tokenizer_or_moved_away_is_named_with_the_fix(fine_tunes, capsys, tmp_path):
    base, runs = fine_tunes
    _, checkpoint = runs["full"]  # it holds every weight: it loads without its base
    moved = base.with_name("base_moved")
    base.rename(moved)
    try:
        message = refusal(capsys, "--checkpoint", str(checkpoint), "--prompt-style", "chat")
    finally:
        moved.rename(base)
    assert f"the base model {base} that the checkpoint records is not there" in message
    assert "pass --tokenizer DIR" in message
    # a model whose directory has no tokenizer, and a vocabulary other than the byte tokenizer's
    hf_chat_setup.save_chat_llama(tmp_path / "model")
    for name in TOKENIZER_FILES:
        (tmp_path / "model" / name).unlink(missing_ok=True)
    message = refusal(capsys, "--checkpoint", str(tmp_path / "model"), "--prompt-style", "chat")
    assert "holds no Hugging Face tokenizer (tokenizer_config.json)" in message
    assert "pass --tokenizer with the tokenizer the model was trained with" in refusal(
        capsys, "--checkpoint", str(tmp_path / "model"))


@pytest.mark.slow
@pytest.mark.parametrize("run", list(RUNS))
def test_the_export_of_a_fine_tune_is_a_directory_transformers_and_generate_use_as_is(fine_tunes, run, capsys,
                                                                                      tmp_path):
    base, runs = fine_tunes
    module, checkpoint = runs[run]
    out = tmp_path / "hf"
    report = convert(checkpoint, out)
    assert f"copied the tokenizer of the base {base}" in report

    tokenizer, base_tokenizer = (transformers.AutoTokenizer.from_pretrained(d) for d in (out, base))
    assert chat_ids(tokenizer) == chat_ids(base_tokenizer)
    assert tokenizer.encode("the user asks again") == base_tokenizer.encode("the user asks again")
    fields, base_fields = (json.loads((d / "config.json").read_text()) for d in (out, base))
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert fields[name] == base_fields[name] is not None, name
    generation = transformers.GenerationConfig.from_pretrained(out)
    assert (generation.eos_token_id, generation.pad_token_id) == (base_tokenizer.eos_token_id,
                                                                  base_tokenizer.pad_token_id)

    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ids = chat_ids(tokenizer)
    with torch.no_grad():  # no token ids passed: the export's generation_config.json says when to stop
        hf_out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)[0].tolist()
    answer = tokenizer.decode(hf_out[len(ids):], skip_special_tokens=True)
    assert answer and answer == expected_answer(module, base)
    assert generated(capsys, "--checkpoint", str(out)) == answer  # our generate reads the export as is


@pytest.mark.slow
def test_to_hf_of_a_module_made_from_a_base_takes_its_tokenizer_and_generation_settings(fine_tunes, tmp_path):
    base, _ = fine_tunes
    module = GPT(pretrained=str(base))
    module.configure_model()  # the base's weights, outside a strategy
    module.to_hf(tmp_path / "hf")
    tokenizer, base_tokenizer = (transformers.AutoTokenizer.from_pretrained(d) for d in (tmp_path / "hf", base))
    assert chat_ids(tokenizer) == chat_ids(base_tokenizer)
    fields, base_fields = (json.loads((d / "config.json").read_text()) for d in (tmp_path / "hf", base))
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert fields[name] == base_fields[name] is not None, name
    assert transformers.GenerationConfig.from_pretrained(tmp_path / "hf").eos_token_id == base_tokenizer.eos_token_id


def test_an_export_without_a_recorded_base_says_what_to_add(tmp_path):
    base = hf_chat_setup.save_chat_llama(tmp_path / "base")
    convert(base, tmp_path / "weights.ckpt")  # a weights-only checkpoint of ours: no `pretrained` recorded
    report = convert(tmp_path / "weights.ckpt", tmp_path / "hf")
    assert "no tokenizer copied: the checkpoint records no base model" in report
    assert not (tmp_path / "hf" / "tokenizer.json").exists()
