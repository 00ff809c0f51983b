"""Generation with a key/value cache: token for token equal to ``transformers``' ``generate`` (GPT-2, Llama, Qwen3 and
Gemma 3 beyond its window, batched prompts of different lengths) in one process and at tp 2/4, pp 2, tp2 x pp2 and
sequence parallelism; seeded sampling identical across layouts and distributed as the filtered softmax;
full-vocabulary logits; and the refusal of full-vocabulary functions on vocab-parallel logits."""

import sys
from pathlib import Path

import pytest
import torch

from launch import run_job
from lightning_megatron.generation import SamplingSettings, VocabParallelSampler, generate
from lightning_megatron.models import GPT, GPTConfig
from lightning_megatron.tensor_parallel import VocabShard

sys.path.insert(0, str(Path(__file__).parent / "workers"))
import generation as worker  # noqa: E402
import hf_gpt2_setup  # noqa: E402
import hf_llama_setup  # noqa: E402

transformers = pytest.importorskip("transformers")

LAYOUTS = {"gpt2": ["tp2", "pp2", "tp2-pp2", "tp2-sp"], "llama-gqa": ["tp2", "pp2", "tp4", "tp2-pp2-sp"],
           "bert": ["tp2-sp", "pp2"]}


@pytest.fixture(scope="module", params=["gpt2", "llama-gqa", "qwen3", "gemma3"])
def hf_and_ours(request):
    hf = hf_gpt2_setup.build_hf_model() if request.param == "gpt2" else hf_llama_setup.build_hf_model(request.param)
    return hf, GPT.from_hf(hf).eval()


@pytest.mark.slow
def test_greedy_equals_transformers_for_batched_prompts_of_different_lengths(hf_and_ours):
    hf, gpt = hf_and_ours
    ids, mask = worker.prompts()
    expected = hf.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0)
    got = gpt.generate(ids, max_new_tokens=20, attention_mask=mask)
    assert got.shape == expected.shape == (3, 27)
    assert torch.equal(got, expected)
    # Lists of token ids: the same continuations, without the padding.
    lists = gpt.generate([row[keep.bool()].tolist() for row, keep in zip(ids, mask)], max_new_tokens=20)
    for row, keep, out in zip(expected, mask, lists):
        assert out == row[torch.cat([keep.bool(), torch.ones(20, dtype=torch.bool)])].tolist()


@pytest.mark.slow
def test_generation_stops_at_eos_and_pads_as_transformers_does(hf_and_ours):
    hf, gpt = hf_and_ours
    ids, mask = worker.prompts()
    free = hf.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0)
    eos = int(free[0, 7 + 4])  # the first prompt's 5th new token: it ends there, the others go on
    expected = hf.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0,
                           eos_token_id=eos)
    got = gpt.generate(ids, max_new_tokens=20, attention_mask=mask, eos_id=eos, pad_id=0)
    assert torch.equal(got, expected)
    ends = 7 + free[0, 7:].tolist().index(eos) + 1
    assert (got[0, ends:] == 0).all()
    single = gpt.generate([ids[0].tolist()], max_new_tokens=20, eos_id=eos)
    assert single[0][-1] == eos and len(single[0]) == ends, "generation stops once every sequence has ended"


@pytest.mark.slow
def test_the_cache_gives_the_logits_of_the_whole_sequence(hf_and_ours):
    """Each cached step's logits equal a full forward over the sequence so far (what the cache saves recomputing)."""
    _, gpt = hf_and_ours
    tokens = gpt.generate(torch.tensor([[5, 17, 42]]), max_new_tokens=6, temperature=1.0, seed=2)
    with torch.no_grad():
        logits = gpt(tokens)
    greedy_again = gpt.generate(tokens[:, :-1], max_new_tokens=1)
    assert int(greedy_again[0, -1]) == int(logits[0, -2].argmax())


@pytest.mark.slow
def test_sampling_draws_from_the_filtered_softmax_as_transformers_filters_it():
    vocab = 50
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(0)) * 2
    settings = [SamplingSettings(temperature=0.7), SamplingSettings(temperature=1.3, top_k=8),
                SamplingSettings(temperature=1.0, top_p=0.6), SamplingSettings(temperature=0.9, top_k=12, top_p=0.7)]
    for setting in settings:
        processors = transformers.LogitsProcessorList([transformers.TemperatureLogitsWarper(setting.temperature)])
        if setting.top_k:
            processors.append(transformers.TopKLogitsWarper(setting.top_k))
        if setting.top_p < 1:
            processors.append(transformers.TopPLogitsWarper(setting.top_p))
        expected = torch.softmax(processors(None, logits.clone()), dim=-1)[0]
        sampler = VocabParallelSampler(setting, VocabShard(None, 0, vocab, vocab, vocab), seed=1)
        draws = torch.cat([sampler(logits.expand(500, vocab)) for _ in range(40)])  # 20,000 draws
        frequency = torch.bincount(draws, minlength=vocab).float() / len(draws)
        assert set(frequency.nonzero().flatten().tolist()) <= set(expected.nonzero().flatten().tolist()), setting
        assert (frequency - expected).abs().max() < 0.015, (setting, (frequency - expected).abs().max())


@pytest.mark.slow
def test_sampling_is_reproducible_from_its_seed_alone_with_dropout_off_and_modes_restored():
    gpt = GPT(GPTConfig(num_layers=2, hidden_size=32, dropout=0.5, attention_dropout=0.5))
    gpt.configure_model()  # in training mode: generation must switch dropout off, then restore the mode
    prompts = [[1, 2, 3], [9]]
    first = gpt.generate(prompts, max_new_tokens=8, temperature=1.0, top_p=0.9, seed=11)
    assert first == gpt.generate(prompts, max_new_tokens=8, temperature=1.0, top_p=0.9, seed=11)
    assert first != gpt.generate(prompts, max_new_tokens=8, temperature=1.0, top_p=0.9, seed=12)
    assert all(m.training for m in gpt.modules())


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_new_tokens=200), "exceeds the model's max_seq_length=128"),
    (dict(max_new_tokens=4, temperature=-1.0), "temperature=-1.0 must be >= 0"),
    (dict(max_new_tokens=4, temperature=1.0, top_p=0.0), "top_p=0.0 must be in"),
    (dict(max_new_tokens=0), "max_new_tokens=0 must be >= 1"),
])
def test_bad_generation_settings_raise(kwargs, message):
    gpt = GPT(GPTConfig(num_layers=1, hidden_size=32))
    gpt.configure_model()
    with pytest.raises(ValueError, match=message):
        gpt.generate(torch.tensor([[1, 2, 3]]), **kwargs)


def test_right_padded_prompts_are_refused():
    gpt = GPT(GPTConfig(num_layers=1, hidden_size=32))
    gpt.configure_model()
    with pytest.raises(ValueError, match="left-padded"):
        generate(gpt.model, torch.tensor([[1, 2, 0]]), attention_mask=torch.tensor([[1, 1, 0]]), max_new_tokens=2)


@pytest.mark.slow
def test_every_layout_generates_what_transformers_and_one_process_do(tmp_path):
    checks = [f"{case}:{layout}" for case, layouts in LAYOUTS.items() for layout in layouts]
    results, _ = run_job("generation", 4, tmp_path, ",".join(checks))
    assert len(results) == 4
    for rank, result in enumerate(results):
        for check in checks:
            got = result[check]
            assert got["full_logits_max_abs_diff"] < 1e-5, (rank, check, got["full_logits_max_abs_diff"])
            if check.startswith("bert"):
                continue
            assert got["greedy_equals_hf"], (rank, check, got["greedy_mismatches"])
            assert all(got["sampled_equal"].values()), (rank, check, got["sampled_equal"])
            if "tp" in check and "pp" not in check:
                assert "cross_entropy() was given vocab-parallel logits" in got["cross_entropy_error"], (rank, check)
                assert "gather_vocab_logits" in got["cross_entropy_error"]
                assert got["argmax_error"].startswith("argmax() was given vocab-parallel logits"), (rank, check)
                assert got["gathered_max_abs_diff"] < 1e-5, (rank, check, got["gathered_max_abs_diff"])


def test_gather_vocab_logits_needs_no_head_at_tp1_and_gives_what_tp2_gives():
    """At tensor_parallel_size=1 the strategy's head still marks its (padded) logits: ``gather_vocab_logits`` drops
    the padding without ``head=``, giving the Hugging Face model's logits, the oracle the tp2 check above gathers to
    (``workers/generation.py``); full-vocabulary functions still work on them, the vocabulary being whole."""
    import torch.nn.functional as F

    from hf_parity import converted
    from lightning_megatron.parallel import ParallelConfig, ParallelState
    from lightning_megatron.tensor_parallel import gather_vocab_logits

    hf = hf_gpt2_setup.build_hf_model()
    model = worker.build(ParallelState.create(ParallelConfig(), "cpu"), converted(hf, seed=hf_gpt2_setup.SEED))
    ids = hf_gpt2_setup.sample_input_ids()[:, :9]
    with torch.no_grad():
        logits, expected = model(ids), hf(ids).logits
    assert logits.shape[-1] > expected.shape[-1]  # the padded vocabulary: 300 -> 384 columns
    torch.testing.assert_close(gather_vocab_logits(logits), expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(gather_vocab_logits(logits.float()[:, -1]), expected[:, -1], atol=1e-5, rtol=0)
    torch.testing.assert_close(F.cross_entropy(logits.flatten(0, 1), ids.flatten()),
                               F.cross_entropy(expected.flatten(0, 1), ids.flatten()), atol=1e-5, rtol=0)
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))
    with pytest.raises(ValueError, match=r"pass the output layer as head= \(e.g. head=model.lm_head\)"):
        gather_vocab_logits(logits.as_subclass(torch.Tensor))
    torch.testing.assert_close(gather_vocab_logits(logits.as_subclass(torch.Tensor), head=model), expected,
                               atol=1e-5, rtol=0)


@pytest.mark.slow
def test_generate_command_reads_a_hugging_face_directory_and_matches_its_generate(tmp_path, capsys):
    from lightning_megatron.data.tokenizers import load_tokenizer
    from lightning_megatron.commands.generate import main as generate_main

    hf = hf_gpt2_setup.build_hf_model(vocab_size=257)  # the byte vocabulary: no tokenizer.json needed
    hf.save_pretrained(tmp_path)
    generate_main(["--checkpoint", str(tmp_path), "--prompt", "print(", "--max-new-tokens", "10", "--no-eos"])
    byte = load_tokenizer("byte")
    expected = hf.generate(torch.tensor([byte.encode("print(")]), max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert capsys.readouterr().out.split("\n" + "-" * 40)[0] == byte.decode(expected[0].tolist())
    hf_gpt2_setup.build_hf_model().save_pretrained(tmp_path / "other")  # vocabulary 300, no tokenizer.json
    no_tokenizer = "holds no tokenizer (tokenizer_config.json or tokenizer.json): pass --tokenizer"
    for checkpoint, message in [(tmp_path / "other", no_tokenizer),
                                (tmp_path / "missing", "No checkpoint at")]:
        with pytest.raises(SystemExit):
            generate_main(["--checkpoint", str(checkpoint), "--prompt", "x"])
        assert message in capsys.readouterr().err.splitlines()[-1]


def test_bert_predict_step_gives_the_masked_tokens_of_hugging_face_bert():
    import hf_bert_setup
    from lightning_megatron.models import BERT

    hf = hf_bert_setup.build_hf_model()
    inputs = hf_bert_setup.sample_inputs()
    with torch.no_grad():
        expected = hf(**inputs).prediction_logits
    out = BERT.from_hf(hf).predict_step(inputs)
    assert out["logits"].dtype == torch.float32 and out["logits"].shape == expected.shape
    assert (out["logits"] - expected).abs().max() < 1e-5
    assert torch.equal(out["predictions"], expected.argmax(dim=-1))
