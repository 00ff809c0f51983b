"""FP8 GEMMs of the tensor-parallel linears (``tensor_parallel.fp8``): per-layer numerics and refusals.

The reference is an emulation written here from the recipes' definitions, not from the code under test: each
operand of a GEMM ``A @ B^T`` (contraction over the columns of both) is scaled by ``finfo.max / amax`` (of the
tensor, or of each row for rowwise, rounded down to a power of two), cast saturating, cast back and unscaled, and
the GEMM runs in fp32. On CPU ``torch._scaled_mm`` dequantizes its operands and runs that fp32 GEMM, so the layer
must equal the emulation to rounding; the emulation in turn must be within the error an 8-bit float can make of
high precision, and not better (fp8 really ran). The multi-rank cases (one launch of 2 gloo ranks,
``workers/fp8_layers.py``) compare every tensor-parallel layer with the single-process FP8 layer.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from launch import run_job
from lightning_megatron.tensor_parallel import ColumnParallelLinear, OverlappedSequenceParallelLinear, parallelize
from lightning_megatron.tensor_parallel.fp8 import Fp8Gemms, Fp8Recipe
from lightning_megatron.tensor_parallel.fp8_plan import check_fp8_options, convert_to_fp8
from lightning_megatron.tensor_parallel.overlap import FP8_OVERLAP_REFUSAL
from lightning_megatron.parallel import ParallelConfig, ParallelState

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
RECIPES = ("tensorwise", "rowwise")
TOKENS_SHAPE, IN, OUT = (2, 7), 64, 48  # 14 tokens: the weight gradient's contraction is padded to 16

# The recipes as the issue defines them: (input/weight format, gradient format, per-row scales rounded to 2^k).
DEFINITIONS = {"tensorwise": (E4M3, E5M2, False), "rowwise": (E4M3, E4M3, True)}


def quantize(t, dtype, rowwise):
    """``t`` (2-D) through ``dtype`` and back, scaled by its amax (per row along dim 1 if ``rowwise``); and the
    scale."""
    t = t.float()
    amax = t.abs().amax(dim=1, keepdim=True) if rowwise else t.abs().amax()
    scale = (torch.finfo(dtype).max / amax.double().clamp(min=1e-12)).float()
    if rowwise:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    fp8_max = torch.finfo(dtype).max
    return (t * scale).clamp(-fp8_max, fp8_max).to(dtype).float() * scale.reciprocal(), scale


def rounding_error(t, dtype, rowwise):
    """The largest ``|q(t) - t|`` elementwise: half an ulp (``u |t|``, ``u`` = 2^-4 for e4m3, 2^-3 for e5m2) of a
    normal number, half the smallest subnormal (unscaled) below."""
    finfo = torch.finfo(dtype)
    _, scale = quantize(t, dtype, rowwise)
    return finfo.eps / 2 * t.abs() + finfo.smallest_normal * finfo.eps / 2 / scale


def gemm_operands(x, weight, grad):
    """The three GEMMs of a linear layer as ``A @ B^T``, both contracted along their rows: ``(A, B, A's format
    role, B's)``. Rowwise scaling is per row of ``A`` and ``B`` (along the contraction)."""
    return {"output": (x, weight, "input", "weight"),
            "input_grad": (grad, weight.t(), "grad", "weight"),
            "weight_grad": (grad.t(), x.t(), "grad", "input")}


def emulate(recipe, x, weight, bias, grad):
    """The FP8 layer's output and gradients (``x [T, K]``, ``weight [N, K]``, ``grad [T, N]``), per GEMM, and
    the bound on each one's distance from the same GEMM in high precision."""
    operand_format, grad_format, rowwise = DEFINITIONS[recipe]
    formats = {"input": operand_format, "weight": operand_format, "grad": grad_format}
    results, bounds = {}, {}
    for name, (a, b, role_a, role_b) in gemm_operands(x, weight, grad).items():
        qa, _ = quantize(a, formats[role_a], rowwise)
        qb, _ = quantize(b, formats[role_b], rowwise)
        results[name] = qa @ qb.t()
        # |qa qb^T - a b^T| <= |qa - a| |b|^T + |qa| |qb - b|^T, plus both fp32 GEMMs' summation error.
        summation = a.shape[1] * torch.finfo(torch.float32).eps * (qa.abs() @ qb.abs().t() + a.abs() @ b.abs().t())
        bounds[name] = (rounding_error(a, formats[role_a], rowwise) @ b.abs().t()
                        + qa.abs() @ rounding_error(b, formats[role_b], rowwise).t() + summation)
    results["output"] = results["output"] + bias
    results["bias_grad"] = grad.sum(0)
    return results, bounds


def inputs(seed=0):
    """An input whose rows span four orders of magnitude (so per-row scales matter, and some values fall below
    e4m3's normal range) and a gradient likewise, with the layer's parameters."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(*TOKENS_SHAPE, IN, generator=generator) * torch.logspace(-2, 2, TOKENS_SHAPE[1]).unsqueeze(1)
    grad = torch.randn(*TOKENS_SHAPE, OUT, generator=generator) * torch.logspace(-3, 0, OUT)
    weight = torch.randn(OUT, IN, generator=generator) / IN ** 0.5
    bias = torch.randn(OUT, generator=generator)
    return x, weight, bias, grad


def fp8_layer(recipe, weight, bias):
    layer = ColumnParallelLinear(IN, OUT)
    layer.weight.data.copy_(weight)
    layer.bias.data.copy_(bias)
    layer.gemms = Fp8Gemms(Fp8Recipe.named(recipe), None, "output")
    return layer


def run_layer(layer, x, grad):
    x = x.clone().requires_grad_()
    y = layer(x)
    y.backward(grad)
    return {"output": y.detach().flatten(0, 1), "input_grad": x.grad.flatten(0, 1),
            "weight_grad": layer.weight.grad, "bias_grad": layer.bias.grad}


def high_precision(x, weight, bias, grad):
    x, grad = x.flatten(0, 1), grad.flatten(0, 1)
    return {"output": F.linear(x, weight, bias), "input_grad": grad @ weight, "weight_grad": grad.t() @ x,
            "bias_grad": grad.sum(0)}


def relative(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_layer_equals_the_emulated_recipe(recipe):
    """Output and the three gradients of an FP8 layer as the emulation's to 1e-6 (the CPU kernel is that
    emulation; a wrong format, scale granularity or power-of-two rounding is off by percents), and not as the
    other recipe's (the emulation tells the two apart on these inputs)."""
    x, weight, bias, grad = inputs()
    got = run_layer(fp8_layer(recipe, weight, bias), x, grad)
    expected, _ = emulate(recipe, x.flatten(0, 1), weight, bias, grad.flatten(0, 1))
    other, _ = emulate(RECIPES[1 - RECIPES.index(recipe)], x.flatten(0, 1), weight, bias, grad.flatten(0, 1))
    for name in expected:
        assert got[name].dtype == torch.float32
        assert relative(got[name], expected[name]) < 1e-6, (name, relative(got[name], expected[name]))
    for name in ("output", "input_grad", "weight_grad"):
        assert relative(got[name], other[name]) > 1e-3, name


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_error_is_within_the_formats_bound_and_of_their_size(recipe):
    """Each element of each GEMM's result is within the error propagated from e4m3's (e5m2's) half ulp and
    subnormal spacing of its operands; the error is not zero, and its median, relative to the high-precision
    result, is a fraction of the coarser format's unit roundoff u (between u / 16 and u; u / 6 to u / 2 here: a
    sum of rounding errors of random signs is smaller than the sum of their magnitudes)."""
    x, weight, bias, grad = inputs()
    emulated, bounds = emulate(recipe, x.flatten(0, 1), weight, bias, grad.flatten(0, 1))
    exact = high_precision(x, weight, bias, grad)
    operand_format, grad_format, _ = DEFINITIONS[recipe]
    units = {"output": torch.finfo(operand_format).eps / 2, "input_grad": torch.finfo(grad_format).eps / 2,
             "weight_grad": torch.finfo(grad_format).eps / 2}  # (the gradient's format is the coarser)
    for name, bound in bounds.items():
        error = (emulated[name] - exact[name]).abs()
        assert bool((error <= bound).all()), (name, (error / bound).max().item())
        median = (error / exact[name].abs()).median().item()
        assert units[name] / 16 < median < units[name], (name, median, units[name])
    assert relative(emulated["bias_grad"], exact["bias_grad"]) == 0.0  # the bias stays in high precision


@pytest.mark.slow
@pytest.mark.parametrize("recipe, dtype", [("tensorwise", torch.float32), ("tensorwise", torch.bfloat16),
                                           ("rowwise", torch.bfloat16)])
def test_fp8_layer_matches_torchaos_float8_linear(recipe, dtype):
    """torchao's ``Float8Linear`` (its recipe of the same name, real ``_scaled_mm``) on the same weights: output and
    gradients within a few fp32 ulp (one where it divides by the scale and this code multiplies by its reciprocal),
    in bf16 to within bf16 rounding. Not rowwise in fp32: torchao rounds those GEMMs' outputs through bf16."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    x, weight, bias, grad = (t.to(dtype) for t in inputs())
    layer = ColumnParallelLinear(IN, OUT, dtype=dtype)
    layer.weight.data.copy_(weight)
    layer.bias.data.copy_(bias)
    layer.gemms = Fp8Gemms(Fp8Recipe.named(recipe), None, "output")
    got = run_layer(layer, x, grad)
    linear = nn.Linear(IN, OUT, dtype=dtype)
    linear.weight.data.copy_(weight)
    linear.bias.data.copy_(bias)
    oracle = convert_to_float8_training(nn.Sequential(linear), config=Float8LinearConfig.from_recipe_name(recipe))
    assert type(oracle[0]).__name__ == "Float8Linear" and not oracle[0].config.emulate
    x_oracle = x.clone().requires_grad_()
    y_oracle = oracle(x_oracle)
    y_oracle.backward(grad)
    expected = {"output": y_oracle.detach().flatten(0, 1), "input_grad": x_oracle.grad.flatten(0, 1),
                "weight_grad": oracle[0].weight.grad, "bias_grad": oracle[0].bias.grad}
    tolerance = 1e-6 if dtype == torch.float32 else 2 ** -8
    for name, value in expected.items():
        assert got[name].dtype == dtype
        error = relative(got[name].float(), value.float())
        assert error < tolerance, (name, error)


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_layer_under_bf16_autocast_outputs_bf16_and_keeps_the_gradients_dtypes(recipe):
    """Under CPU autocast the GEMM writes bf16 (the emulated fp32 result rounded once, then the bias in bf16), from
    the fp32 weight cast to FP8 directly; the gradients keep the dtypes of the fp32 parameters and input."""
    x, weight, bias, grad = inputs()
    layer = fp8_layer(recipe, weight, bias)
    x = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    y.backward(grad.to(torch.bfloat16))
    assert y.dtype == torch.bfloat16
    assert (x.grad.dtype, layer.weight.grad.dtype, layer.bias.grad.dtype) == (torch.float32,) * 3
    expected, _ = emulate(recipe, x.detach().flatten(0, 1), weight, torch.zeros(OUT), grad.flatten(0, 1))
    expected_output = expected["output"].to(torch.bfloat16) + bias.to(torch.bfloat16)
    assert torch.equal(y.detach().flatten(0, 1), expected_output)
    # The gradients' GEMMs take the bf16 gradient and write bf16: as the emulation's, to bf16 rounding.
    expected, _ = emulate(recipe, x.detach().flatten(0, 1), weight, bias, grad.to(torch.bfloat16).float().flatten(0, 1))
    assert relative(x.grad.flatten(0, 1), expected["input_grad"]) < 2 ** -8
    assert relative(layer.weight.grad, expected["weight_grad"]) < 2 ** -8


@pytest.mark.parametrize("fp8, exclude, overlap, message", [
    ("e4m3", (), False, r"fp8='e4m3' is not one of \('tensorwise', 'rowwise'\) \(or None for no FP8\)"),
    (None, ("blocks.0.*",), False, r"fp8_exclude=\['blocks.0.\*'\] .* but fp8=None: set fp8 to 'tensorwise' or "
                                   r"'rowwise', or drop fp8_exclude"),
    # A string would be a list of one-letter patterns: refused, with or without fp8.
    ("tensorwise", "blocks.0.*", False, r"got the string 'blocks.0.\*': write fp8_exclude=\['blocks.0.\*'\]"),
    (None, "blocks.0.*", False, r"got the string 'blocks.0.\*': write fp8_exclude=\['blocks.0.\*'\]"),
    ("rowwise", (), True, r"tp_comm_overlap=True .* Use tp_comm_overlap=False with fp8"),
])
def test_fp8_options_that_do_not_compose_are_refused_naming_the_values_and_the_fix(fp8, exclude, overlap, message):
    from lightning_megatron.strategy import Megatron3DStrategy

    with pytest.raises(ValueError, match=message):
        check_fp8_options(fp8, exclude, overlap)
    with pytest.raises(ValueError, match=message):  # the strategy checks when it is built, before any launch
        Megatron3DStrategy(fp8=fp8, fp8_exclude=exclude, tp_comm_overlap=overlap, sequence_parallel=overlap)


def test_overlapped_sequence_parallel_layers_refuse_fp8_gemms():
    """Used directly, without the strategy's check: the overlapped column would cast each rank's chunk by itself."""
    gemms = Fp8Gemms(Fp8Recipe.named("tensorwise"), None, "output")
    x, weight = torch.randn(1, 4, 16), torch.randn(16, 16)
    with pytest.raises(ValueError, match=FP8_OVERLAP_REFUSAL.split(",")[0]):
        OverlappedSequenceParallelLinear().column(x, weight, None, None, gemms)
    with pytest.raises(ValueError, match=FP8_OVERLAP_REFUSAL.split(",")[0]):
        OverlappedSequenceParallelLinear().row(x, weight, None, gemms)
    with pytest.raises(ValueError, match=r"cuts must be 'output' \(column-parallel\) or 'input' \(row-parallel\), "
                                         r"got 'rows'"):
        Fp8Gemms(Fp8Recipe.named("tensorwise"), None, "rows")


class _Block(nn.Module):
    def __init__(self, hidden, ffn, vocab=100):
        super().__init__()
        self.emb, self.fc, self.proj = nn.Embedding(vocab, hidden), nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)


def _parallel_block(hidden, ffn):
    block = _Block(hidden, ffn)
    state = ParallelState.create(ParallelConfig(), "cpu")
    parallelize(block, {"emb": "vocab", "fc": "column", "proj": "row", "head": "vocab"}, state)
    return block, state


def test_convert_to_fp8_converts_the_plan_linears_but_the_head_and_the_excluded():
    block, state = _parallel_block(32, 48)
    recipe = Fp8Recipe.named("rowwise")
    assert convert_to_fp8(block, recipe, state, ("fc",)) == ["proj"]
    assert not block.fc.gemms.fp8 and block.proj.gemms == Fp8Gemms(recipe, None, "input") and not block.head.gemms.fp8
    # Naming the head is allowed (it stays in high precision either way), not reported as matching nothing.
    assert convert_to_fp8(_parallel_block(32, 48)[0], recipe, state, ("head",)) == ["fc", "proj"]
    assert convert_to_fp8(block, None, state, ()) == []


def test_qwen3_runs_its_wider_heads_projections_in_fp8_and_keeps_its_qk_norms_in_high_precision():
    """Qwen3's qkv (heads 16 channels wide in a 32-wide model: 8 x 16 rows) and output projections are plan linears
    like any other; its q/k norms are not, and keep their fp32 gains and gradients (``fp8_plan``'s rule: norms stay in
    high precision). One step's loss is within FP8's error of the high-precision model's, and not equal to it."""
    from workers.gpt_setup import QWEN3_CONFIG, batches
    from lightning_megatron.models import GPT

    losses, grads = {}, {}
    for fp8 in (False, True):
        torch.manual_seed(0)
        module = GPT(QWEN3_CONFIG)
        module.configure_model()
        state = ParallelState.create(ParallelConfig(), "cpu")
        parallelize(module, module.tensor_parallel_plan(), state)
        if fp8:
            converted = convert_to_fp8(module, Fp8Recipe.named("rowwise"), state)
            assert converted == [f"model.blocks.{i}.{name}" for i in range(QWEN3_CONFIG.num_layers)
                                 for name in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")]
            assert module.model.blocks["0"].attn.qkv.weight.shape == (8 * 16, 32)
        input_ids, labels = batches()[0]
        loss_sum, tokens = module.model.loss(input_ids, labels)[:2]
        (loss_sum / tokens).backward()
        losses[fp8] = (loss_sum / tokens).item()
        norm = module.model.blocks["0"].attn.q_norm.weight
        assert norm.dtype == torch.float32 and norm.grad.dtype == torch.float32 and norm.grad.abs().sum() > 0
        grads[fp8] = norm.grad.clone()
    assert losses[True] != losses[False] and abs(losses[True] - losses[False]) < 1e-3 * losses[False], losses
    assert not torch.equal(grads[True], grads[False]) and relative(grads[True], grads[False]) < 0.2


@pytest.mark.parametrize("hidden, ffn, exclude, message", [
    (32, 24, (), r"FP8 cannot run fc: its local output features 24 \(at tensor_parallel_size=1\) are not multiples "
                 r"of 16, .*\(add its name to fp8_exclude\), or pick sizes whose per-rank slices are multiples of 16"),
    (32, 24, ("fc",), r"FP8 cannot run proj: its local input features 24 "),
    (32, 48, ("fc", "blocks.*"), r"fp8_exclude patterns \['blocks.\*'\] match no column- or row-parallel linear of "
                                 r"_Block; names look like \['proj'\]"),
    (32, 48, ("fc", "proj"), r"fp8='tensorwise' found no column- or row-parallel linear to run in FP8 in _Block "
                             r"\(fp8_exclude=\['fc', 'proj'\]\): exclude fewer layers, set fp8=None"),
])
def test_convert_to_fp8_refuses_naming_the_layer_and_the_fix(hidden, ffn, exclude, message):
    block, state = _parallel_block(hidden, ffn)
    with pytest.raises(ValueError, match=message):
        convert_to_fp8(block, Fp8Recipe.named("tensorwise"), state, exclude)


@pytest.fixture(scope="module")
def tensor_parallel_results(tmp_path_factory):
    results, _ = run_job("fp8_layers", 2, tmp_path_factory.mktemp("fp8_layers"))
    assert len(results) == 2
    return results


LAYERS = ("column", "column_sp", "packed", "query_groups", "experts_column", "row", "row_sp", "experts_row",
          "column_autocast", "column_sp_autocast")


@pytest.mark.slow
def test_tensor_parallel_fp8_layers_equal_the_single_process_fp8_layer(tensor_parallel_results):
    """At tp2, each rank's part of the output and of the input, weight and bias gradients equals the single-process
    FP8 layer's to 1e-6 (fp32 summation order of partial sums), both recipes: column and row layers with and without
    sequence parallelism, packed and query-group columns (key/value rows replicated on both ranks), the experts'
    column and row layers inside an MoE region. Under bf16 autocast the column layer's input gradient is a sum of
    partial GEMM outputs each rounded to bf16 (as without FP8): to bf16 rounding."""
    for rank, result in enumerate(tensor_parallel_results):
        errors = result["errors"]
        assert set(errors) == {f"{layer}_{recipe}_{tensor}" for layer in LAYERS for recipe in RECIPES
                               for tensor in ("output", "input_grad", "weight_grad", "bias_grad")
                               if (layer, tensor) != ("experts_row", "bias_grad")}  # (no bias inside a region)
        rounded = {name for name in errors if "autocast" in name and name.endswith("input_grad")}
        worst = {name: value for name, value in errors.items() if value > (2 ** -7 if name in rounded else 1e-6)}
        assert not worst, f"rank {rank}: {worst}"


@pytest.mark.slow
def test_the_amax_reduction_over_tensor_parallel_ranks_is_what_makes_them_equal(tensor_parallel_results):
    """Negative controls, where a GEMM contracts over the cut dimension: a row layer whose input rows all have their
    amax in rank 0's shard (2^16 times the rest, on input features with zero weights), and a column layer whose
    output gradient rows do (on an output feature with zero weights). With the amaxes reduced over tp the row
    layer's output and the column layer's input gradient are the single-process layer's; with the group removed
    (``Fp8Gemms(recipe, None, cuts)``) rank 1 scales its part of each row by its own amax, and they are off by
    percents of their largest value (tensorwise and rowwise). (Rowwise scales are powers of two, so a row scaled by
    a smaller amax rounds alike except below e4m3's normal range: hence the 2^16, which puts the rest of each row
    there.)"""
    for result in tensor_parallel_results:
        controls = result["controls"]
        for recipe in RECIPES:
            for layer, tensor in (("row", "output"), ("column", "input_grad")):
                assert controls[f"{layer}_reduced_{recipe}_{tensor}"] < 1e-6, controls
                assert controls[f"{layer}_local_{recipe}_{tensor}"] > 0.02, controls


@pytest.mark.slow
def test_tensor_parallel_fp8_under_autocast_outputs_bf16_and_fp32_gradients(tensor_parallel_results):
    for result in tensor_parallel_results:
        for layout in ("tensorwise", "tensorwise_sp", "rowwise", "rowwise_sp"):
            assert result["dtypes"][layout] == ["torch.bfloat16"] + ["torch.float32"] * 3, layout


@pytest.mark.slow
def test_convert_to_fp8_at_tp2_reduces_over_the_tensor_parallel_group_and_checks_local_sizes(tensor_parallel_results):
    for result in tensor_parallel_results:
        converted = result["converted"]
        assert converted["names"] == ["fc", "proj"] and converted["gemms"] == [True, True]
        assert converted["refusal"].startswith(
            "FP8 cannot run fc: its local output features 24 (at tensor_parallel_size=2) are not multiples of 16")
        assert "add its name to fp8_exclude" in converted["refusal"]
        assert converted["replicated_refusal"].startswith("FP8 cannot run qkv at tensor_parallel_size=2: ranks [0, 1] "
                                                          "share its output rows 64..95"), converted
        assert "fp8_exclude=['qkv']" in converted["replicated_refusal"]


@pytest.mark.slow
def test_tensor_parallel_fp8_casts_weights_once_per_step_and_batches_the_amax_all_reduces(tensor_parallel_results):
    """A column + row MLP at tp2, two SGD steps of 1 and of 4 micro-batches: the losses and weights are the
    single-process FP8 MLP's; each step's amax all-reduces (MAX) are the same in the second step as in the first
    (the weights recast once after the optimizer step), grow by exactly one per layer per extra micro-batch (the
    activation amax that must be reduced: the row layer's input in forward, the column layer's output gradient in
    backward; the weights' amaxes ride along the first micro-batch's), and a step of one micro-batch needs at most
    three (before: tensorwise 8 and rowwise 4 per micro-batch, 32 and 16 per step of 4)."""
    layers = 2
    for result in tensor_parallel_results:
        steps = result["steps"]
        for recipe in RECIPES:
            one, four = steps[f"{recipe}_mb1"], steps[f"{recipe}_mb4"]
            for run in (one, four):
                assert run["loss_error"] < 1e-6 and run["weight_error"] < 1e-6, (recipe, run)
                assert run["amax_all_reduces"][0] == run["amax_all_reduces"][1], (recipe, run)
            assert four["amax_all_reduces"][0] == one["amax_all_reduces"][0] + 3 * layers, (recipe, steps)
            assert one["amax_all_reduces"][0] <= 3, (recipe, steps)
