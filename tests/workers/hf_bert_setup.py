"""The small random Hugging Face BERT shared by ``tests/test_hf_bert.py`` and its worker ``hf_parity.py``."""

import torch

SEED = 0
HF_FIELDS = dict(vocab_size=300, hidden_size=64, num_attention_heads=4, num_hidden_layers=2, intermediate_size=96,
                 max_position_embeddings=48, type_vocab_size=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                 layer_norm_eps=1e-12, pad_token_id=0)
BATCH, SEQ = 3, 32  # SEQ splits over tp=2 under sequence parallelism
TOLERANCE = 1e-4  # fp32; measured 0.0 at tp=1 (the same ops in the same order)


def build_hf_model(class_name: str = "BertForPreTraining", **overrides):
    """A ``transformers`` BERT built offline, every parameter random (LayerNorm gains and biases included, so that
    no mapping error hides behind an init of ones or zeros), in eval mode."""
    import transformers

    torch.manual_seed(SEED)
    model = getattr(transformers, class_name)(transformers.BertConfig(**{**HF_FIELDS, **overrides})).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.5)
    return model


def sample_inputs() -> dict[str, torch.Tensor]:
    """Token ids, a padding mask (two of three rows padded) and two segments: what BERT's forward takes."""
    generator = torch.Generator().manual_seed(SEED)
    input_ids = torch.randint(0, HF_FIELDS["vocab_size"], (BATCH, SEQ), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 23:], attention_mask[2, 7:] = 0, 0
    token_type_ids = (torch.arange(SEQ) >= 12).long().expand(BATCH, SEQ).contiguous()
    token_type_ids[0, 20:] = 2  # a third segment type: type_vocab_size=3 is used
    return {"input_ids": input_ids, "attention_mask": attention_mask, "token_type_ids": token_type_ids}
