"""Model, data and Trainer options shared by the Trainer worker and its single-process reference."""

from lightning_megatron.checkpoint import entries
from lightning_megatron.data import GPTDataModule
from lightning_megatron.models import GPT, GPTConfig


class UnevenlyMaskedGPT(GPT):
    """Ignores the labels of every token id divisible by 7: dp ranks then count different tokens."""

    def training_step(self, batch, batch_idx):
        labels = batch["labels"].masked_fill(batch["labels"] % 7 == 0, -100)
        return super().training_step({**batch, "labels": labels}, batch_idx)


def model(options: dict) -> GPT:
    if "pretrained" in options:  # a Hugging Face directory the test wrote, with LoRA when the options name it
        return GPT(pretrained=options["pretrained"], lora=options.get("lora"), learning_rate=3e-3, warmup_steps=2,
                   adam_eps=options.get("adam_eps", 1e-6))
    sizes = dict(vocab_size=257, max_seq_length=32, hidden_size=options.get("hidden", 32),
                 num_layers=options.get("layers", 2), num_heads=options.get("heads", 4))
    if "preset" in options:  # a Llama-shaped model: its pieces from the preset, the sizes above
        config = GPTConfig.from_name(options["preset"], **sizes, num_query_groups=options.get("groups"),
                                     ffn_hidden_size=options.get("ffn", 48))
    else:
        config = GPTConfig(**sizes, mtp={"num_layers": options["mtp"]} if "mtp" in options else None)
    # adam_eps 1e-6: with 1e-8, AdamW turns fp32 rounding in near-zero gradients into full-size updates.
    model_class = UnevenlyMaskedGPT if options.get("uneven_tokens") else GPT
    return model_class(config, learning_rate=3e-3, warmup_steps=2, adam_eps=options.get("adam_eps", 1e-6))


def datamodule(options: dict) -> GPTDataModule:
    return GPTDataModule(seq_length=32, global_batch_size=8, max_files=24, seed=3, split="80,10,10")


# What the Trainer worker's predict option generates from (sampling: the tokens must not depend on the layout).
PREDICT_PROMPTS = [[5, 9, 12], [40], [7, 7, 7, 7, 7], [100, 3]]
PREDICT_GENERATION = {"max_new_tokens": 6, "temperature": 0.9, "top_k": 10, "seed": 4}


def trainer_kwargs(options: dict) -> dict:
    steps = options.get("steps", 5)
    return dict(max_steps=steps, accumulate_grad_batches=options.get("accumulate", 1),
                gradient_clip_val=options.get("clip", 0.5), limit_val_batches=2, limit_test_batches=2,
                val_check_interval=options.get("val_every", steps),
                num_sanity_val_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                enable_model_summary=False)


def held_pieces(trainer) -> list:
    """Every tensor piece this rank holds for a checkpoint (weights, fp32 main params, optimizer state) as
    ``(key, offsets, piece)`` rows: what a resumed run must hold box for box."""
    training = trainer.strategy._parts().rank_training()
    placements = training.placements()
    held = {**training.model_entries(), **entries.main_param_entries(training.main_params, placements)}
    for index, optimizer in enumerate(training.optimizers):
        held.update(entries.optimizer_entries(optimizer, index, placements))
    return [(key, list(offsets), piece.clone()) for key, entry in held.items() for offsets, piece in entry.pieces.items()]
