"""SFT from a Hugging Face directory (``GPT(pretrained=DIR)``): the directory's tokenizer and chat template are the
data's default, ``pretrained`` takes precedence over a config file's preset, a tokenizer the model was not trained
with is refused naming both sizes, and the command ``configs/llama-tiny-sft.yaml`` gives works as written."""

import json
from types import SimpleNamespace

import pytest
import torch

from lightning_megatron.data import SFTDataModule
from lightning_megatron.data.chat_templates import ChatTemplateFormat
from lightning_megatron.models import GPT, GPTConfig

transformers = pytest.importorskip("transformers")
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CHAT = [{"role": "user", "content": "Reverse cat."}, {"role": "assistant", "content": "Answer: tac"}]


def bpe_tokenizer(vocab_size, chat_template=CHATML):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(["Reverse the letters of cat. Answer: tac. user assistant"] * 20, trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>")
    fast.chat_template = chat_template
    return fast


def save_llama(directory, vocab_size):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="module")
def base_hf(tmp_path_factory):
    """A tiny Hugging Face Llama saved with its BPE tokenizer (ChatML markers and template), as a user's base."""
    directory = tmp_path_factory.mktemp("base_hf")
    tokenizer = bpe_tokenizer(300)
    tokenizer.save_pretrained(directory)
    save_llama(directory, len(tokenizer))
    return SimpleNamespace(path=str(directory), tokenizer=tokenizer)


def attached(dm, model):
    """What the trainer shows the data module in setup: the model, and dp 1."""
    dm.trainer = SimpleNamespace(lightning_module=model, strategy=SimpleNamespace(
        distributed_sampler_kwargs={"num_replicas": 1, "rank": 0}), max_steps=-1)
    return dm


def test_the_pretrained_directory_gives_the_model_the_tokenizer_and_the_chat_template(base_hf, tmp_path):
    model = GPT("llama-tiny", pretrained=base_hf.path)  # a config file's preset: the directory takes precedence
    assert model.config.vocab_size == len(base_hf.tokenizer) and model.config.hidden_size == 32
    assert model.config != GPTConfig.from_name("llama-tiny")
    rows = tmp_path / "chat.jsonl"
    rows.write_text(json.dumps({"messages": CHAT}) + "\n")
    dm = attached(SFTDataModule(data_path=str(rows), seq_length=64, global_batch_size=1, split="1"), model)
    dm.setup("fit")
    assert dm.tokenizer_choice() == base_hf.path and isinstance(dm.format, ChatTemplateFormat)
    tokens = dm.train_dataset[0]["input_ids"].tolist()
    rendered = base_hf.tokenizer.apply_chat_template(CHAT, tokenize=True, return_dict=False)
    assert tokens[: len(rendered)] == list(rendered)
    trained = [t for t in dm.train_dataset[0]["labels"].tolist() if t != -100]
    assert base_hf.tokenizer.decode(trained) == "Answer: tac<|im_end|>\n"
    # without a model's directory the default stays the byte tokenizer, with the plain style
    assert SFTDataModule().tokenizer_choice() == "byte"
    # a base model's tokenizer without a chat template, taken by default, writes the plain style
    base = tmp_path / "base"
    bpe_tokenizer(300, chat_template=None).save_pretrained(base)
    save_llama(base, len(base_hf.tokenizer))
    dm = attached(SFTDataModule(data_path=str(rows), seq_length=64, global_batch_size=1, split="1"),
                  GPT(pretrained=str(base)))
    dm.setup("fit")
    assert dm.tokenizer_choice() == str(base) and dm.format.style.user == "User: {content}\nAssistant: "


def test_a_tokenizer_the_model_was_not_trained_with_is_refused_naming_both_sizes(base_hf, tmp_path):
    model, size = GPT(pretrained=base_hf.path), len(base_hf.tokenizer)
    with pytest.raises(ValueError, match=rf"vocabulary of {size} ids, but the tokenizer 'byte' has 257.*Leave "
                                         rf"tokenizer unset \(no --data.init_args.tokenizer\)"):
        attached(SFTDataModule(tokenizer="byte"), model).setup("fit")
    other = bpe_tokenizer(270)
    other.save_pretrained(tmp_path / "other")
    assert len(other) != size
    with pytest.raises(ValueError, match=rf"has {len(other)} ids, but the model pretrained=.* which has {size}; leave "
                                         rf"tokenizer unset"):
        attached(SFTDataModule(tokenizer=str(tmp_path / "other")), model).setup("fit")
    # a directory without a tokenizer: the byte default does not fit its ids, and the fix is named
    bare = save_llama(tmp_path / "bare", size)
    with pytest.raises(ValueError, match=r"tokenizer 'byte' has 257.*Pass tokenizer \(--data.init_args.tokenizer\) "
                                         r"the tokenizer directory or tokenizer.json the model was trained with "
                                         r"\(.*bare holds none\)"):
        attached(SFTDataModule(), GPT(pretrained=bare)).setup("fit")
    # the same tokenizer from another place is fine
    base_hf.tokenizer.save_pretrained(tmp_path / "copy")
    attached(SFTDataModule(tokenizer=str(tmp_path / "copy"), seq_length=32), model).check_model(model.config)


@pytest.mark.slow
def test_the_sft_config_fine_tunes_a_pretrained_directory_as_its_header_says(base_hf, tmp_path):
    from lightning_megatron.cli import run_lightning_cli

    cli = run_lightning_cli([
        "fit", "--config", "configs/llama-tiny-sft.yaml", "--model.init_args.pretrained", base_hf.path,
        "--trainer.devices", "1", "--trainer.strategy.init_args.tensor_parallel_size", "1",
        "--trainer.strategy.init_args.sequence_parallel", "false", "--trainer.max_steps", "2",
        "--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "1",
        "--trainer.default_root_dir", str(tmp_path), "--data.init_args.global_batch_size", "2",
        "--data.init_args.seq_length", "64"])
    assert cli.model.config.vocab_size == len(base_hf.tokenizer) and cli.datamodule.tokenizer_choice() == base_hf.path
    assert isinstance(cli.datamodule.format, ChatTemplateFormat)
    assert torch.isfinite(cli.trainer.callback_metrics["val_loss"])
