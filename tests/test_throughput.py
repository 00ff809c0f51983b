"""Throughput that can be trusted: the model-FLOPs formula, TokenThroughput in real Trainer runs at tp2 x dp2 and
pp2 x dp2 (against Lightning's ThroughputMonitor in the same runs), and the LR schedule of a run with no last step."""

import json
import logging

import lightning as L
from fractions import Fraction

import pytest
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.data import DataLoader
from torch.utils.flop_counter import FlopCounterMode
from lightning.pytorch.callbacks import ThroughputMonitor
from lightning.pytorch.loggers.logger import Logger

from launch import run_job
from lightning_megatron.callbacks import (PEAK_FLOPS, TokenThroughput, _model_flops, compute_dtype, device_family,
                                          peak_flops_of)
from lightning_megatron.models import BERT, GPT, BERTConfig, GPTConfig, GPTModel
from lightning_megatron.models.bert import BERTModel
from lightning_megatron.models.experts import grouped_gemm_flops
from lightning_megatron.models.flops import (bert_flops_per_batch, flops_per_batch, gpt_flops_per_batch,
                                             megatron_flops_per_batch)


def megatron_by_hand(batch_size, seq_length, num_layers, hidden_size, vocab_size):
    """Narayanan et al. 2021 by hand, without the recomputed forward (the paper's 96 and 16 become 72 and 12)."""
    b, s, l, h, v = batch_size, seq_length, num_layers, hidden_size, vocab_size
    return 72 * b * s * l * h ** 2 * (1 + s / (6 * h) + v / (12 * l * h))


# ------------------------------------------------------------------ the formula, in one process
GPT2_SHAPED = [("gpt-tiny", {}), ("gpt2-124m", {}), ("gpt-1.3b", {}), ("gpt-8.3b", {}),
               ("gpt-tiny", dict(hidden_size=48, num_heads=3, num_layers=3, vocab_size=1000))]


@pytest.mark.parametrize("name, overrides", GPT2_SHAPED)
@pytest.mark.parametrize("batch_size, seq_length", [(1, 1), (8, 128), (3, 1024)])
def test_formula_is_megatrons_for_gpt2_shapes(name, overrides, batch_size, seq_length):
    config = GPTConfig.from_name(name, **overrides)
    exact = megatron_flops_per_batch(batch_size=batch_size, seq_length=seq_length, num_layers=config.num_layers,
                                     hidden_size=config.hidden_size, vocab_size=config.vocab_size)
    assert gpt_flops_per_batch(config, batch_size, seq_length) == exact
    by_hand = megatron_by_hand(batch_size, seq_length, config.num_layers, config.hidden_size, config.vocab_size)
    assert exact == pytest.approx(by_hand, rel=1e-12)


def counted_by_torch(model, loss_of_model):
    """FLOPs torch's FlopCounterMode counts in one forward and backward (math attention: its matmuls are counted;
    MoE experts' grouped GEMMs by ``grouped_gemm_flops``)."""
    counter = FlopCounterMode(display=False, custom_mapping={torch.ops.aten._grouped_mm: grouped_gemm_flops})
    with sdpa_kernel(SDPBackend.MATH), counter:
        loss_of_model(model).backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("config", [
    GPTConfig(hidden_size=32, num_layers=2, num_heads=4),
    # grouped-query attention, SwiGLU, untied head
    GPTConfig.from_name("llama-tiny", hidden_size=32, num_heads=4, num_query_groups=2, ffn_hidden_size=48),
    GPTConfig.from_name("llama-tiny", num_query_groups=1, tie_embeddings=True),  # multi-query, tied
    GPTConfig.from_name("llama-tiny", num_layers=2, add_qkv_bias=True, ffn_hidden_size=40),
    # dropless MoE: every token through its top-2 of 4 experts, a dense layer, a gated shared expert
    GPTConfig.from_name("llama-tiny", num_layers=3, moe=dict(num_experts=4, top_k=2, ffn_hidden_size=24,
                                                             layer_freq=(1, 0, 1), shared_expert_size=16,
                                                             shared_expert_gate=True)),
], ids=["gpt2", "llama-gqa", "mqa-tied", "qkv-bias", "moe"])
def test_gpt_formula_counts_what_torch_counts(config):
    torch.manual_seed(0)
    batch, seq = 3, 16
    tokens = torch.randint(0, config.vocab_size, (batch, seq))
    counted = counted_by_torch(GPTModel(config), lambda model: model.loss(tokens, tokens)[0])
    assert gpt_flops_per_batch(config, batch, seq) == counted


@pytest.mark.parametrize("config", [BERTConfig(hidden_size=32, num_heads=4), BERTConfig(binary_head=False),
                                    BERTConfig(norm_position="post", ffn_hidden_size=96)],
                         ids=["pre-norm", "no-binary-head", "post-norm"])
def test_bert_formula_counts_what_torch_counts(config):
    torch.manual_seed(0)
    batch, seq = 3, 16
    tokens = torch.randint(0, config.vocab_size, (batch, seq))
    side = dict(attention_mask=torch.ones(batch, seq))
    if config.binary_head:
        side["sentence_order_labels"] = torch.zeros(batch, dtype=torch.long)
    counted = counted_by_torch(BERTModel(config), lambda model: model.loss(tokens, tokens, **side).loss_sum)
    assert bert_flops_per_batch(config, batch, seq) == counted
    assert config.flops_per_batch(batch, seq) == counted


@pytest.mark.parametrize("name", sorted(GPTConfig.presets()))
def test_formula_is_six_n_plus_attention_for_every_preset(name):
    """The 6N rule (N: matrix-multiply weights, the output layer's included) plus 12 l s (heads x head_dim) per
    token (a sliding layer's s: its window), with N read off the model built on the meta device."""
    config = GPTConfig.from_name(name)
    with torch.device("meta"):
        model = GPTModel(config)
    # An expert's weights are used by top_k / num_experts of the tokens; the router is a matrix multiply too.
    share = (lambda name: Fraction(config.moe.top_k, config.moe.num_experts) if ".experts." in name else 1) if (
        config.moe) else (lambda name: 1)
    n = sum(share(name) * module.weight.numel() for name, module in model.named_modules() if isinstance(module, nn.Linear))
    n += sum(module.weight.numel() for name, module in model.named_modules() if name.endswith("router"))
    batch, seq = 2, 4096
    keys = sum(min(config.attention_window(index) or seq, seq) for index in range(config.num_layers))  # windows
    attention = 12 * keys * config.num_heads * config.head_dim
    assert gpt_flops_per_batch(config, batch, seq) == batch * seq * (6 * n + attention)


def test_flops_per_batch_dispatches_on_the_config():
    assert flops_per_batch(GPTConfig(), 2, 8) == gpt_flops_per_batch(GPTConfig(), 2, 8)
    assert flops_per_batch(BERTConfig(), 2, 8) == bert_flops_per_batch(BERTConfig(), 2, 8)
    with pytest.raises(TypeError, match="flops_per_batch"):
        flops_per_batch(object(), 2, 8)


def test_the_callback_finds_the_model_flops():
    """A method, the config (GPT, BERT: models/flops.py, also before their number, one device's share), a number
    (Lightning's attribute), nothing."""
    assert _model_flops(BERT(), 2, 8) == bert_flops_per_batch(BERTConfig(), 2, 8)
    assert _model_flops(GPT(), 2, 8) == gpt_flops_per_batch(GPTConfig(), 2, 8)

    class Numbered(L.LightningModule):
        flops_per_batch = 123

    class Method(L.LightningModule):
        def flops_per_batch(self, batch_size, seq_length):
            return batch_size * seq_length

    class NumberedGPT(GPT):
        flops_per_batch = 123

    assert _model_flops(Numbered(), 2, 8) == 123
    assert _model_flops(Method(), 2, 8) == 16
    assert _model_flops(NumberedGPT(), 2, 8) == gpt_flops_per_batch(GPTConfig(), 2, 8)
    assert _model_flops(L.LightningModule(), 2, 8) is None


def test_peak_flops_table():
    assert device_family("NVIDIA H100 80GB HBM3") == "h100 sxm"
    assert device_family("NVIDIA H100 PCIe") == "h100 pcie"
    assert device_family("NVIDIA H200") == "h200 sxm"
    assert device_family("NVIDIA H200 NVL") == "h200 nvl"
    assert device_family("NVIDIA A100-SXM4-80GB") == device_family("NVIDIA A100 80GB PCIe") == "a100"
    assert device_family("Tesla V100-SXM2-16GB") == "v100 sxm"
    assert device_family("Tesla V100-PCIE-32GB") == "v100 pcie"
    assert device_family("NVIDIA GeForce RTX 4090") is None
    assert PEAK_FLOPS["h100 sxm"]["bf16"] == PEAK_FLOPS["h200 sxm"]["bf16"] == 989.5e12
    assert PEAK_FLOPS["a100"]["bf16"] == 312e12 and PEAK_FLOPS["v100 sxm"]["fp16"] == 125e12
    assert compute_dtype("bf16-mixed") == "bf16" and compute_dtype("16-mixed") == "fp16"
    assert compute_dtype("32-true") == "fp32"  # torch's default float32 matmul precision, "highest": no TF32
    assert peak_flops_of(torch.device("cpu"), "bf16-mixed") is None


class RecordingLogger(Logger):
    name, version = "recording", 0

    def __init__(self):
        super().__init__()
        self.records = []

    def log_hyperparams(self, params, *args, **kwargs):
        pass

    def log_metrics(self, metrics, step=None):
        self.records.append({key: float(value) for key, value in metrics.items()})


class Advance(L.Callback):
    """Moves a test clock on: ``step_seconds[k - 1]`` at the end of step k, 100 s for each validation batch."""

    def __init__(self, step_seconds):
        self.now, self.step_seconds = 0.0, step_seconds

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if (batch_idx + 1) % trainer.accumulate_grad_batches == 0:
            self.now += self.step_seconds[trainer.global_step - 1]

    def on_validation_batch_end(self, *args, **kwargs):
        self.now += 100.0


def tiny_gpt_data(rows=32, seq=16):
    torch.manual_seed(0)
    tokens = torch.randint(0, 257, (rows, seq))
    return DataLoader([{"input_ids": row, "labels": row} for row in tokens], batch_size=2)


def test_one_process_accumulation_validation_and_no_mfu_on_cpu(caplog):
    """Single device: the step's tokens over both accumulated micro-batches, validation left out of the next step's
    time, no MFU without a peak on CPU (said once), FLOPs from the module's config."""
    seconds = [1.0, 0.5, 0.25, 2.0]
    advance = Advance(seconds)
    ours = TokenThroughput(clock=lambda: advance.now)
    logger = RecordingLogger()
    config = GPTConfig(hidden_size=32, num_layers=1, num_heads=2, max_seq_length=16)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=len(seconds), accumulate_grad_batches=2,
                        callbacks=[advance, ours], logger=logger, log_every_n_steps=1, val_check_interval=4,
                        limit_val_batches=1, num_sanity_val_steps=0, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    caplog.set_level(logging.INFO)
    trainer.fit(GPT(config), tiny_gpt_data(), tiny_gpt_data(rows=4))
    assert any("val_loss" in record for record in logger.records), "validation ran between steps 2 and 3"
    logged = [record for record in logger.records if "tokens_per_sec" in record]
    tokens = 2 * 2 * 16  # two micro-batches of 2 x 16 tokens
    flops = megatron_by_hand(2 * 2, 16, 1, 32, 257)
    assert [r["tokens_per_sec"] for r in logged] == pytest.approx([tokens / s for s in seconds[1:]], rel=1e-6)
    assert [r["tflops_per_device"] for r in logged] == pytest.approx([flops / s / 1e12 for s in seconds[1:]], rel=1e-6)
    assert not any("mfu" in record for record in logger.records)
    said = [r.getMessage() for r in caplog.records if "MFU is not logged" in r.getMessage()]
    assert len(said) == 1 and "CPU" in said[0] and "peak_flops=" in said[0]


class BatchFlopsSeen(L.Callback):
    """``pl_module.flops_per_batch`` as Lightning's ThroughputMonitor reads it, after each batch."""

    def __init__(self):
        self.train, self.validation = [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.train.append((pl_module.flops_per_batch, tuple(batch["input_ids"].shape)))

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self.validation.append((pl_module.flops_per_batch, tuple(batch["input_ids"].shape)))


def tiny_bert_data(rows=8, seq=16):
    torch.manual_seed(0)
    tokens = torch.randint(5, 100, (rows, seq))
    samples = [{"input_ids": row, "labels": row, "attention_mask": torch.ones(seq),
                "token_type_ids": torch.zeros_like(row), "sentence_order_label": torch.tensor(0)} for row in tokens]
    return DataLoader(samples, batch_size=2)


@pytest.mark.parametrize("kind", ["gpt", "bert"])
def test_lightnings_throughput_monitor_runs_on_the_provided_modules(kind):
    """Today's code: ``TypeError: unsupported operand type(s) for *: 'method' and 'int'`` at the first batch. The
    number Lightning reads is the model FLOPs of each batch (forward + backward; forward only for validation)."""
    if kind == "gpt":
        config = GPTConfig(vocab_size=257, hidden_size=32, num_layers=1, num_heads=2, max_seq_length=16)
        module, train, val, formula = GPT(config), tiny_gpt_data(8), tiny_gpt_data(rows=3), gpt_flops_per_batch
    else:
        config = BERTConfig(vocab_size=128, hidden_size=32, num_layers=1, num_heads=2, max_seq_length=16)
        module, train, val, formula = BERT(config), tiny_bert_data(), tiny_bert_data(rows=3), bert_flops_per_batch
    seen, logger = BatchFlopsSeen(), RecordingLogger()
    monitor = ThroughputMonitor(batch_size_fn=lambda batch: batch["input_ids"].shape[0], window_size=2)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=3, callbacks=[monitor, seen], logger=logger,
                        log_every_n_steps=1, val_check_interval=3, limit_val_batches=2, num_sanity_val_steps=0,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    assert module.flops_per_batch is None, "no batch seen yet"
    trainer.fit(module, train, val)
    assert len(seen.train) == 3 and [shape for _, shape in seen.validation] == [(2, 16), (1, 16)]
    for flops, shape in seen.train:
        assert flops == formula(config, *shape)
    for flops, shape in seen.validation:
        assert flops == formula(config, *shape) / 3
    assert any("train/device/flops_per_sec" in record for record in logger.records)


# ------------------------------------------------------------------ real Trainer runs, 4 ranks, one launch
DURATIONS = [0.5, 0.25, 2.0, 1.0, 4.0]  # seconds of step k (durations[k - 1]) on the worker's step clock
PEAK = 1e8
LAYOUTS = [dict(name="tp2xdp2", tp=2, pp=1, accumulate=1),
           dict(name="pp2xdp2", tp=1, pp=2, accumulate=2, micro_batch_size=2),
           dict(name="tp2xpp2", tp=2, pp=2, accumulate=1, micro_batch_size=4)]  # dp = 1: Lightning 4x too high
GLOBAL_BATCH_SIZE, SEQ, HIDDEN, LAYERS, VOCAB = 8, 32, 32, 2, 257  # trainer_setup.datamodule, the worker's GPT


@pytest.fixture(scope="module")
def throughput_runs(tmp_path_factory):
    options = dict(clock="steps", durations=DURATIONS, peak_flops=PEAK, steps=len(DURATIONS), layouts=LAYOUTS)
    results, _ = run_job("throughput", 4, tmp_path_factory.mktemp("throughput"), json.dumps(options))
    assert len(results) == 4
    return results


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS, ids=[layout["name"] for layout in LAYOUTS])
def test_logged_throughput_is_the_global_batch_over_dp(throughput_runs, layout):
    world, dp = 4, 4 // (layout["tp"] * layout["pp"])
    per_rank = GLOBAL_BATCH_SIZE // dp  # the data module's split over dp
    global_batch = per_rank * dp * layout["accumulate"]
    flops = megatron_by_hand(global_batch, SEQ, LAYERS, HIDDEN, VOCAB)
    for result in throughput_runs:
        run = result[layout["name"]]
        assert (run["dp"], run["world_size"], run["per_rank_batch"]) == (dp, world, per_rank)
        logged = [record for record in run["records"] if "tokens_per_sec" in record]
        assert len(logged) == len(DURATIONS) - 1, "every optimizer step but the first"
        for record, seconds in zip(logged, DURATIONS[1:]):
            assert record["tokens_per_sec"] == pytest.approx(global_batch * SEQ / seconds, rel=1e-6)
            assert record["tflops_per_device"] == pytest.approx(flops / seconds / world / 1e12, rel=1e-6)
            assert record["mfu"] == pytest.approx(flops / seconds / world / PEAK, rel=1e-6)
        assert {"tokens_per_sec", "tflops_per_device", "mfu"} <= set(run["progress_bar"])


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS, ids=[layout["name"] for layout in LAYOUTS])
def test_lightnings_throughput_monitor_is_tp_times_pp_too_high(throughput_runs, layout):
    """Lightning's numbers per step (its rate times its own step time, from its logged ``train/time``) against the
    truth: samples of the global batch, and model FLOPs per device."""
    world, dp = 4, 4 // (layout["tp"] * layout["pp"])
    global_batch = GLOBAL_BATCH_SIZE * layout["accumulate"]
    true_flops_per_device = megatron_by_hand(global_batch, SEQ, LAYERS, HIDDEN, VOCAB) / world
    records = throughput_runs[0][layout["name"]]["records"]  # Lightning's monitor logs on rank 0 only
    times = [record["train/time"] for record in records if "train/time" in record]
    rates = [record for record in records if "train/samples_per_sec" in record]
    assert len(times) == len(DURATIONS) and len(rates) == len(DURATIONS) - 1
    for record, start, end in zip(rates, times, times[1:]):
        samples = record["train/samples_per_sec"] * (end - start)
        flops_per_device = record["train/device/flops_per_sec"] * (end - start)
        assert samples == pytest.approx(layout["tp"] * layout["pp"] * global_batch, rel=1e-6)
        assert flops_per_device == pytest.approx(world // dp * true_flops_per_device, rel=1e-6)


PROVIDED = [dict(name="gpt-tp2", tp=2, model="gpt"), dict(name="bert-tp2", tp=2, model="bert")]


@pytest.fixture(scope="module")
def provided_module_runs(tmp_path_factory):
    options = dict(clock="steps", durations=DURATIONS[:3], peak_flops=PEAK, steps=3, layouts=PROVIDED)
    results, _ = run_job("throughput", 2, tmp_path_factory.mktemp("provided"), json.dumps(options))
    assert len(results) == 2
    return results


@pytest.mark.slow
@pytest.mark.parametrize("layout", PROVIDED, ids=[layout["name"] for layout in PROVIDED])
def test_lightnings_throughput_monitor_counts_flops_per_device_of_the_provided_modules(provided_module_runs, layout):
    """GPT and BERT at tp2 under Lightning's own launcher: its per-device FLOP/s times its own step time is the model
    FLOPs of the rank's batch (models/flops.py) shared by the two tensor-parallel ranks. Today's code: TypeError."""
    config = GPTConfig(vocab_size=VOCAB, max_seq_length=SEQ, hidden_size=HIDDEN, num_layers=LAYERS, num_heads=4)
    formula = gpt_flops_per_batch
    if layout["model"] == "bert":
        config, formula = BERTConfig.from_name("bert-tiny"), bert_flops_per_batch
    run = provided_module_runs[0][layout["name"]]  # Lightning's monitor logs on rank 0 only
    assert (run["dp"], run["world_size"]) == (1, 2)
    per_device = formula(config, run["per_rank_batch"], run["seq_length"]) / layout["tp"]
    times = [record["train/time"] for record in run["records"] if "train/time" in record]
    rates = [record for record in run["records"] if "train/device/flops_per_sec" in record]
    assert len(times) == 3 and len(rates) == 2
    for record, start, end in zip(rates, times, times[1:]):
        assert record["train/device/flops_per_sec"] * (end - start) == pytest.approx(per_device, rel=1e-6)
        assert record["train/flops_per_sec"] * (end - start) == pytest.approx(2 * per_device, rel=1e-6)
    ours = [record for record in provided_module_runs[1][layout["name"]]["records"] if "tflops_per_device" in record]
    ours_per_device = [record["tflops_per_device"] * 1e12 * seconds for record, seconds in zip(ours, DURATIONS[1:3])]
    assert ours_per_device == pytest.approx([per_device] * 2)  # TokenThroughput agrees


# ------------------------------------------------------------------ a run with no last step (max_time)
class LearningRates(L.Callback):
    """The learning rate each step trains with; stops the (otherwise hour-long) run after ``steps``."""

    def __init__(self, steps):
        self.steps, self.learning_rates = steps, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.learning_rates.append(trainer.optimizers[0].param_groups[0]["lr"])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        trainer.should_stop = trainer.global_step >= self.steps


def test_max_time_without_max_steps_warms_up_then_holds(caplog):
    """Today's code: OverflowError (int of an infinite ``estimated_stepping_batches``) in configure_optimizers."""
    torch.manual_seed(0)
    tokens = torch.randint(0, 257, (24, 16))
    data = DataLoader([{"input_ids": row, "labels": row} for row in tokens], batch_size=4)
    model = GPT(GPTConfig(hidden_size=32, num_layers=1, num_heads=2, max_seq_length=16), learning_rate=1e-3,
                min_learning_rate=1e-4, warmup_steps=2)
    rates = LearningRates(steps=5)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_time="00:00:01:00", max_steps=-1, callbacks=[rates],
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    caplog.set_level(logging.INFO)
    trainer.fit(model, data)
    assert trainer.estimated_stepping_batches == float("inf") and trainer.global_step == 5
    # Warmup over 2 steps (1e-3 x 1/2, 2/2), then held at learning_rate: there is no last step for a cosine.
    assert rates.learning_rates == pytest.approx([5e-4, 1e-3, 1e-3, 1e-3, 1e-3])
    messages = [record.getMessage() for record in caplog.records if "no last step" in record.getMessage()]
    assert len(messages) == 1 and "set Trainer(max_steps=...) for the cosine" in messages[0], messages


def test_a_finite_run_still_decays_to_min_learning_rate():
    model = GPT(GPTConfig(hidden_size=32, num_layers=1, num_heads=2), learning_rate=1e-3, min_learning_rate=1e-4,
                warmup_steps=2)
    trainer = L.Trainer(accelerator="cpu", max_steps=10, logger=False)
    model.trainer = trainer
    model.configure_model()
    scheduler = model.configure_optimizers()["lr_scheduler"]["scheduler"]
    for _ in range(10):
        scheduler.optimizer.step()
        scheduler.step()
    assert scheduler.get_last_lr()[0] == pytest.approx(1e-4)
