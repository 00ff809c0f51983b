"""The small random Hugging Face GPT-2 shared by ``tests/test_hf_gpt2.py`` and its worker ``hf_parity.py``."""

import torch

SEED = 0
HF_FIELDS = dict(n_embd=64, n_head=4, n_layer=2, vocab_size=300, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                 attn_pdrop=0.0, bos_token_id=None, eos_token_id=None)
BATCH, SEQ = 2, 64  # every position embedding is used; SEQ splits over tp=2 under sequence parallelism
TOLERANCE = 1e-5  # measured ~5e-7; exact instead of tanh GELU alone moves the logits by ~1.4e-4


def build_hf_model(**overrides):
    """A ``GPT2LMHeadModel`` built offline, every parameter random (LayerNorm gains and biases included, so that
    no mapping error hides behind an init of ones or zeros), in eval mode."""
    import transformers

    torch.manual_seed(SEED)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**{**HF_FIELDS, **overrides})).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.2)
    return model


def sample_input_ids() -> torch.Tensor:
    return torch.randint(0, HF_FIELDS["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(SEED))
