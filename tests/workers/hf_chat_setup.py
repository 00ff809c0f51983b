"""A tiny Hugging Face chat model directory made offline, as a new user's base model is: a random ``LlamaForCausalLM``
with a byte-level BPE tokenizer trained here, ChatML's markers and template, and its special ids in ``config.json``."""

from pathlib import Path

import torch

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIAL = ["<s>", "<pad>", "<|im_start|>", "<|im_end|>"]
TEXT = ["hello world, the user asks and the assistant answers: yes sir, again and again"] * 20


def build_tokenizer():
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(TEXT, trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="<|im_end|>",
                                                pad_token="<pad>", chat_template=CHATML)


def save_chat_llama(directory, seed: int = 0) -> Path:
    """Write the model and its tokenizer to ``directory`` (``save_pretrained`` of both); returns the directory."""
    import transformers

    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=48,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=64, bos_token_id=tokenizer.bos_token_id,
                                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return Path(directory)
