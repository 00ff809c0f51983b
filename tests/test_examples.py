"""The example scripts run as a user runs them (2 processes each, a few steps; all started at once)."""

import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples"))

from custom_loss import PrefixFreeGPT  # noqa: E402
from launch import Started, selected  # noqa: E402


EXAMPLES = [
    # The Llama-shaped preset (RMSNorm, rotary, SwiGLU, GQA) with sequence parallelism; gpt-tiny's
    # path through the same script is the CLI's default run.
    ("train_gpt.py", ["--max-steps=2", "--max-files=30", "--pipeline-parallel-size=1", "--preset=llama-tiny",
                      "--sequence-parallel"], "max_steps=2"),
    ("train_bert.py", ["--max-steps=2"], "max_steps=2"),
    ("custom_loss.py", ["--max-steps=2", "--max-files=30"], "max_steps=2"),
    ("trainer_strategy_string.py", ["--max-steps=30"], "final train_loss"),
]


@pytest.fixture(scope="module")
def started(request, tmp_path_factory):
    """Every example this session runs, started together when the first one's test begins (an example's second
    process imports while its first waits: one example at a time leaves a core idle); each test reads its own."""
    runs = {script: Started([sys.executable, str(REPO / "examples" / script), *args],
                            tmp_path_factory.mktemp(Path(script).stem))
            for script, args, _ in EXAMPLES if selected(request, "test_example_runs", script=script)}
    yield runs
    for run in runs.values():
        run.stop()


@pytest.mark.slow
@pytest.mark.parametrize("script, args, expect", EXAMPLES)
def test_example_runs(script, args, expect, started):
    result = started[script].result()
    assert result.returncode == 0, result.stderr[-4000:]
    assert expect in result.stdout + result.stderr


def test_custom_loss_skips_the_context_prefix():
    torch.manual_seed(0)
    model = PrefixFreeGPT("gpt-tiny", context_tokens=8)
    model.configure_model()
    ids = torch.randint(0, 257, (2, 32))
    batch = {"input_ids": ids, "labels": torch.roll(ids, -1, dims=1)}
    out = model.training_step(batch, 0)
    assert int(out["num_tokens"]) == 2 * (32 - 8)
    expected = torch.nn.functional.cross_entropy(model(ids)[:, 8:].flatten(0, 1), batch["labels"][:, 8:].flatten())
    assert torch.allclose(out["loss"], expected, atol=1e-6)
