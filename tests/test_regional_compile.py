"""Regional compilation: what it refuses, and recomputation of the compiled layers (one process; the layouts are in
test_layout_invariance, the Trainer wiring in test_strategy)."""

import pytest
import torch
from torch._dynamo.utils import counters

from workers.recompute_setup import CONFIG, LAYERS, SEED, max_deviation, two_steps
from lightning_megatron import Megatron3DStrategy
from lightning_megatron.generation import generate
from lightning_megatron.models import GPTModel
from lightning_megatron.parallel import ParallelConfig
from lightning_megatron.transforms.recompute import apply_activation_checkpointing
from lightning_megatron.transforms.regional_compile import check_compile_layout, compile_layers, compile_options


def test_compile_options():
    assert compile_options(False) is None and compile_options(True) == {}
    assert compile_options({"backend": "aot_eager"}) == {"backend": "aot_eager"}
    with pytest.raises(ValueError, match=r"'bakend' is not an argument of torch.compile; use 'fullgraph', "):
        compile_options({"bakend": "aot_eager"})
    with pytest.raises(ValueError, match=r"fullgraph.*cannot work.*Leave fullgraph out"):
        compile_options({"fullgraph": True})
    with pytest.raises(ValueError, match=r"compile must be True, False or a dict"):
        Megatron3DStrategy(compile="inductor")


@pytest.mark.parametrize("compile, alternative", [
    ({"mode": "reduce-overhead"}, r"Use \{'mode': 'default'\}"),
    ({"mode": "max-autotune"}, r"Use \{'mode': 'max-autotune-no-cudagraphs'\}"),
    ({"options": {"triton.cudagraphs": True}}, r"Leave triton.cudagraphs out"),
])
def test_cuda_graph_modes_are_refused_in_the_constructor(compile, alternative):
    """CUDA graphs would replay the layers' kernels around eager dropout-stream swaps and collectives: refused when
    the strategy is built (on every rank, before any process group), naming the value and the alternative."""
    with pytest.raises(ValueError, match=r"compile=\{.*\} is not supported: it captures CUDA graphs.*" + alternative):
        Megatron3DStrategy(compile=compile)
    assert compile_options({"mode": "max-autotune-no-cudagraphs"}) == {"mode": "max-autotune-no-cudagraphs"}


@pytest.mark.parametrize("sizes, message", [
    ({"context_parallel_size": 2}, r"compile with context_parallel_size=2 is not supported yet"),
    ({"expert_parallel_size": 2, "data_parallel_size": 2}, r"compile with expert_parallel_size=2 is not supported yet"),
])
def test_refused_layouts(sizes, message):
    with pytest.raises(ValueError, match=message):
        check_compile_layout(ParallelConfig(**sizes), "none")


def test_selective_recomputation_is_refused():
    with pytest.raises(ValueError, match=r"activation_checkpointing='selective' is not supported.*Use activation_checkpoint"):
        check_compile_layout(ParallelConfig(), "selective")


def compiled_gpt(recompute: str) -> GPTModel:
    """Dropout on: the eager backend runs dynamo's graphs as eager code, so the masks are eager's too."""
    torch.manual_seed(SEED)
    model = GPTModel(CONFIG)
    compile_layers(model, LAYERS, {"backend": "eager"})
    return apply_activation_checkpointing(model, mode=recompute, layer_pattern=LAYERS)


def test_full_recomputation_checkpoints_the_compiled_forward():
    """Dropout on: recomputing the compiled layer replays its masks (losses and gradients bit-identical)."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(SEED)
    reference = two_steps(GPTModel(CONFIG))
    assert max_deviation(two_steps(compiled_gpt("full")), reference) == 0.0
    assert counters["frames"]["ok"] > 0, "the checkpoint ran the layers' uncompiled forward"


def test_compiling_after_recomputation_is_refused():
    model = apply_activation_checkpointing(GPTModel(CONFIG), mode="full", layer_pattern=LAYERS)
    with pytest.raises(ValueError, match=r"blocks.0 \(TransformerLayer\) already has its own `forward`.*before activation"):
        compile_layers(model, LAYERS, {})


@pytest.mark.slow
def test_generation_with_compiled_layers_gives_the_eager_tokens():
    """The key/value cache and the changing sequence lengths of generation go through the compiled layers."""
    torch.manual_seed(SEED)
    eager = GPTModel(CONFIG).eval()
    compiled = GPTModel(CONFIG).eval()
    compiled.load_state_dict(eager.state_dict())
    compile_layers(compiled, LAYERS, {"backend": "aot_eager"})
    prompts = [[5, 9, 12], [40, 3]]
    assert generate(compiled, prompts, max_new_tokens=6) == generate(eager, prompts, max_new_tokens=6)
