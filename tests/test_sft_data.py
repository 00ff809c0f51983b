"""Supervised fine-tuning data (``data/sft.py`` and its modules): the loss only on responses, exact on
hand-written conversations with the byte tokenizer and a Hugging Face chat template made here; prompts that get
no gradient; packed conversations that do not see each other; overlong and malformed rows; the same global
batches at dp=1 and dp=2, and a resume that neither repeats nor skips."""

import json
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lightning_megatron.data import SFTDataModule
from lightning_megatron.data.conversations import Message
from lightning_megatron.data.corpus import ByteTokenizer
from lightning_megatron.data.instructions import ANSWER_PATTERN, instruction_set
from lightning_megatron.data.prompt_styles import PromptStyle, PromptStyleFormat
from lightning_megatron.data.sft_dataset import SFTDataset, fit_to_window
from lightning_megatron.models import GPTConfig, GPTModel

EOS = ByteTokenizer.eos_id
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CHAT = [{"role": "system", "content": "Be short."}, {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "world"}, {"role": "user", "content": "again"},
        {"role": "assistant", "content": "yes sir"}]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def attach(dm, dp_size=1, dp_rank=0):
    """What a parallel strategy would show the data module: its dp size and rank."""
    dm.trainer = SimpleNamespace(strategy=SimpleNamespace(distributed_sampler_kwargs={"num_replicas": dp_size,
                                                                                      "rank": dp_rank}))
    return dm


def byte_sample(messages, seq_length, packing=False):
    encoded = PromptStyleFormat(PromptStyle.of("plain"), ByteTokenizer()).encode(
        [Message(m["role"], m["content"]) for m in messages])
    return SFTDataset([encoded], seq_length=seq_length, pad_id=EOS, packing=packing)[0]


def expected_labels(pieces, seq_length):
    """Labels written out from ``(text, trained)`` pieces (the byte ids of each, an assistant piece followed by eos):
    the target of position i is token i + 1, -100 unless trained; then padding, -100."""
    tokens, trained = [], []
    for text, response in pieces:
        ids = list(text.encode()) + ([EOS] if response else [])
        tokens += ids
        trained += [response] * len(ids)
    labels = [t if keep else -100 for t, keep in zip(tokens[1:], trained[1:])]
    return tokens, labels + [-100] * (seq_length - len(labels))


def test_prompt_and_chat_labels_are_exact_with_the_byte_tokenizer():
    sample = byte_sample([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], 32)
    text = "User: hi\nAssistant: "
    assert bytes(sample["input_ids"][: len(text)].tolist()).decode() == text
    padding = 32 - len(text) - 2
    assert sample["labels"].tolist() == [-100] * (len(text) - 1) + [ord("y"), ord("o"), EOS] + [-100] * padding
    assert sample["input_ids"][len(text) + 2:].tolist() == [EOS] * padding  # the eos, then padding
    assert set(sample) == {"input_ids", "labels"}

    sample = byte_sample(CHAT, 96)  # multi-turn: every assistant turn is trained, each with its eos
    pieces = [("System: Be short.\n", False), ("User: hello\nAssistant: ", False), ("world", True),
              ("User: again\nAssistant: ", False), ("yes sir", True)]
    tokens, labels = expected_labels(pieces, 96)
    assert sample["labels"].tolist() == labels
    assert sample["input_ids"][: len(tokens)].tolist() == tokens
    trained = [t for t in sample["labels"].tolist() if t != -100]
    assert trained == list(b"world") + [EOS] + list(b"yes sir") + [EOS]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A Hugging Face tokenizer directory made offline: a small byte-level BPE with ChatML's markers and template."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|im_start|>", "<|im_end|>", "<s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(["hello world, user assistant system: yes sir, again"] * 20, trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>")
    directory = tmp_path_factory.mktemp("hf_tokenizer")
    fast.save_pretrained(directory)
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[
        ("<s>", tokenizer.token_to_id("<s>"))])  # one that starts every text it encodes with <s>, as Llama's
    with_bos = directory / "bos"
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>",
                                         bos_token="<s>").save_pretrained(with_bos)
    with_template = directory / "chat"
    fast.chat_template = CHATML
    fast.save_pretrained(with_template)
    return SimpleNamespace(plain=str(directory), chat=str(with_template), bos=str(with_bos), hf=fast)


def test_a_chat_template_trains_the_assistant_turns_and_their_end_markers(hf_dir, tmp_path):
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}])
    dm = SFTDataModule(data_path=data, tokenizer=hf_dir.chat, seq_length=64, global_batch_size=1, split="1")
    dm.setup("fit")
    sample = dm.train_dataset[0]
    rendered = hf_dir.hf.apply_chat_template(CHAT, tokenize=False)
    tokens = sample["input_ids"].tolist()
    length = len(hf_dir.hf.apply_chat_template(CHAT, tokenize=True, return_dict=False))
    assert hf_dir.hf.decode(tokens[:length]) == rendered
    decode = lambda ids: hf_dir.hf.decode(ids, skip_special_tokens=False)  # noqa: E731
    labels = sample["labels"].tolist()
    assert decode([t for t in labels if t != -100]) == "world<|im_end|>\nyes sir<|im_end|>\n"
    # everything else is the prompt: the untrained targets and the first token make up the rest of the rendering
    assert decode(tokens[:1] + [t for t, lab in zip(tokens[1:length], labels) if lab == -100]) == rendered.replace(
        "world<|im_end|>\n", "").replace("yes sir<|im_end|>\n", "")
    assert dm.vocab_size == len(hf_dir.hf) and dm.tokenizer.eos_id == hf_dir.hf.convert_tokens_to_ids("<|im_end|>")

    # prediction continues in the same format: the prompt is the conversation up to where the response starts
    dm = SFTDataModule(data_path=data, tokenizer=hf_dir.chat, seq_length=64, global_batch_size=1, split="1",
                       predict_prompts=["hello"])
    assert decode(dm.prompts[0]) == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"


def test_a_tokenizer_without_a_chat_template_names_the_fix(hf_dir, tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"has no chat template.*prompt_style='plain'"):
        SFTDataModule(tokenizer=hf_dir.plain)
    # with a prompt style it writes plain text through the tokenizer, each response ended by its eos
    dm = SFTDataModule(tokenizer=hf_dir.plain, prompt_style="plain")
    encoded = dm.format.encode([Message("user", "hello"), Message("assistant", "world")])
    assert hf_dir.hf.decode(encoded.ids, skip_special_tokens=False) == "User: hello\nAssistant: world<|im_end|>"
    assert hf_dir.hf.decode([i for i, t in zip(encoded.ids, encoded.trained) if t],
                            skip_special_tokens=False) == "world<|im_end|>"
    # a tokenizer that starts each text with its beginning-of-sequence token starts each conversation with it
    dm = SFTDataModule(tokenizer=hf_dir.bos, prompt_style="plain")
    with_bos = dm.format.encode([Message("user", "hello"), Message("assistant", "world")])
    assert with_bos == ([dm.tokenizer.hf.bos_token_id] + encoded.ids, [False] + encoded.trained)
    # a template that rewrites what comes before cannot have its response spans found
    broken = hf_dir.hf.__class__.from_pretrained(hf_dir.chat)
    broken.chat_template = "{% for m in messages %}{{ m['content'] }}|{% endfor %}{{ messages | length }}"
    broken.save_pretrained(tmp_path / "broken")
    dm = SFTDataModule(tokenizer=str(tmp_path / "broken"))
    with pytest.raises(ValueError, match="turn 1 as a prefix"):
        dm.format.encode([Message("user", "hello"), Message("assistant", "world")])
    # transformers is optional: its absence is named with the install line
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match="pip install transformers"):
        SFTDataModule(tokenizer=hf_dir.chat)


def tiny_config(kind="gpt", **overrides):
    sizes = {**dict(vocab_size=257, max_seq_length=64, hidden_size=32, num_layers=2, num_heads=4, ffn_hidden_size=64),
             **overrides}
    if kind == "llama":
        return GPTConfig.from_name("llama-tiny", **sizes, num_query_groups=2)
    return GPTConfig(**sizes)


def test_prompt_tokens_get_no_gradient(tmp_path):
    """A data set where the prompt carries all the signal (a long, fully predictable run) and the response is a
    word: the logits of every prompt and padding position get exactly zero gradient, and the parameters' gradient
    is that of a cross-entropy over the response tokens written out here from the raw text."""
    rows = [{"prompt": "ab" * 12, "response": "xyz"}, {"prompt": "cd" * 10, "response": "no"}]
    dm = SFTDataModule(data_path=write_jsonl(tmp_path / "d.jsonl", rows), seq_length=48, global_batch_size=2, split="1")
    dm.setup("fit")
    batch = next(iter(attach(dm).train_dataloader()))
    torch.manual_seed(0)
    model = GPTModel(tiny_config())
    logits = []

    def keep(module, args, out):
        out.retain_grad()
        logits.append(out)

    model.lm_head.register_forward_hook(keep)
    loss_sum, num_tokens = model.loss(batch["input_ids"], batch["labels"])
    loss_sum.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    logit_grad = logits[0].grad.abs().sum(-1)
    trained = batch["labels"] != -100
    assert torch.all(logit_grad[~trained] == 0) and torch.all(logit_grad[trained] > 0)
    assert int(num_tokens) == sum(len(row["response"]) + 1 for row in rows)

    # the same loss by hand: for each row, the positions predicting a response byte or the eos after it
    model.zero_grad()
    out = model(batch["input_ids"])
    hand = 0.0
    for b, ids in enumerate(batch["input_ids"].tolist()):
        row = next(r for r in rows if bytes(ids[6: 6 + len(r["prompt"])]) == r["prompt"].encode())
        start = len(f"User: {row['prompt']}\nAssistant: ")
        targets = torch.tensor(list(row["response"].encode()) + [EOS])
        hand = hand + F.cross_entropy(out[b, start - 1: start - 1 + len(targets)], targets, reduction="sum")
    hand.backward()
    assert abs(hand.item() - loss_sum.item()) < 1e-5 * hand.item()
    for name, p in model.named_parameters():
        assert torch.allclose(p.grad, grads[name], atol=1e-6), name


@pytest.mark.parametrize("kind", ["gpt", "llama"])  # learned positions (which must restart) and rotary ones
def test_packed_conversations_equal_each_alone(kind):
    rows = [[{"role": "user", "content": "Reverse abc."}, {"role": "assistant", "content": "cba"}],
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
            [{"role": "user", "content": "one"}, {"role": "assistant", "content": "two"},
             {"role": "user", "content": "three"}, {"role": "assistant", "content": "four"}]]
    encode = PromptStyleFormat(PromptStyle.of("plain"), ByteTokenizer()).encode
    encoded = [encode([Message(m["role"], m["content"]) for m in row]) for row in rows]
    lengths = [len(e.ids) for e in encoded]
    seq_length = sum(lengths) + 5
    packed_set = SFTDataset(encoded, seq_length=seq_length, pad_id=EOS, packing=True)
    assert len(packed_set) == 1
    packed = packed_set[0]
    starts = np.cumsum([0] + lengths)
    assert packed["position_ids"].tolist() == [p for n in lengths + [6] for p in range(n)][:seq_length]
    assert packed["document_ids"].tolist() == [d for d, n in enumerate(lengths + [6]) for _ in range(n)][:seq_length]

    torch.manual_seed(0)
    model = GPTModel(tiny_config(kind, max_seq_length=seq_length))
    with torch.no_grad():
        side = {k: packed[k][None] for k in ("position_ids", "document_ids")}
        logits = model(packed["input_ids"][None], **side)[0]
        packed_loss = model.loss(packed["input_ids"][None], packed["labels"][None], **side)[0]
        alone_loss = 0.0
        for start, e in zip(starts, encoded):
            alone = SFTDataset([e], seq_length=seq_length, pad_id=EOS, packing=False)[0]
            alone_logits = model(alone["input_ids"][None])[0]
            assert torch.equal(packed["labels"][start: start + len(e.ids) - 1], alone["labels"][: len(e.ids) - 1])
            n = len(e.ids)
            assert (logits[start: start + n] - alone_logits[:n]).abs().max() < 1e-5
            alone_loss = alone_loss + model.loss(alone["input_ids"][None], alone["labels"][None])[0]
        # without the document masks the later conversations do see the earlier ones
        mixed = model(packed["input_ids"][None])[0]
        assert (mixed[starts[1]: starts[2]] - logits[starts[1]: starts[2]]).abs().max() > 1e-3
    assert abs(packed_loss.item() - alone_loss.item()) < 1e-5 * alone_loss.item()


def test_overlong_conversations_are_truncated_or_dropped_and_counted(tmp_path):
    rows = [{"prompt": "a", "response": "b"}, {"prompt": "c", "response": "d" * 40},  # a long response: cut
            {"prompt": "e" * 40, "response": "f"}, {"prompt": "g", "response": "h"}]  # a long prompt: nothing to learn
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    dm = SFTDataModule(data_path=data, seq_length=24, global_batch_size=1, split="1")
    with pytest.warns(UserWarning, match=r"2 of 4 conversations .* 1 truncated \(their ends cut\), 1 dropped"):
        dm.setup("fit")
    assert len(dm.train_dataset) == 3
    cut = next(dm.train_dataset[i] for i in range(3) if dm.train_dataset[i]["input_ids"][6] == ord("c"))
    prompt = len("User: c\nAssistant: ")
    assert cut["labels"].tolist() == [-100] * (prompt - 1) + [ord("d")] * (25 - prompt)  # cut at the window: no eos
    dm = SFTDataModule(data_path=data, seq_length=24, global_batch_size=1, split="1", overlong="drop")
    with pytest.warns(UserWarning, match=r"2 of 4 conversations .*: 2 dropped \(overlong='drop'\)"):
        dm.setup("fit")
    assert len(dm.train_dataset) == 2
    with pytest.raises(ValueError, match="None of the 4 conversations of the train split fits seq_length"):
        SFTDataModule(data_path=data, seq_length=8, global_batch_size=1, split="1").setup("fit")
    with pytest.raises(FileNotFoundError, match="SFT data .*missing.jsonl does not exist"):
        SFTDataModule(data_path=str(tmp_path / "missing.jsonl"))
    (tmp_path / "d.csv").write_text("prompt,response\n")
    with pytest.raises(ValueError, match=r"must be a .jsonl file .* or a .parquet file"):
        SFTDataModule(data_path=str(tmp_path / "d.csv"))
    with pytest.raises(ValueError, match="overlong='cut' must be one of"):
        SFTDataModule(overlong="cut")
    one = dm.format.encode([Message("user", "x"), Message("assistant", "y")])
    assert fit_to_window([one], len(one.ids), "drop") == ([one], 0, 0)  # exactly seq_length + 1 tokens fit whole
    assert fit_to_window([one], len(one.ids) - 1, "drop") == ([], 0, 1)
    assert fit_to_window([one], len(one.ids) - 1, "truncate") == ([(one.ids[:-1], one.trained[:-1])], 1, 0)


@pytest.mark.parametrize("line, reason", [
    ({"prompt": "hi"}, r"'response' is missing"),
    ({"prompt": "hi", "response": "  "}, r"the response \(message 1\) is empty"),
    ({"prompt": "hi", "response": 3}, r"'response' is a int, not a string"),
    ({"text": "hi"}, r"no 'messages' and no 'prompt'/'response' \(keys: 'text'\)"),
    ({"messages": [{"role": "assistant", "content": "x"}]}, r"message 0 is a 'assistant' turn where a 'user'"),
    ({"messages": [{"role": "user", "content": "x"}]}, r"the last message \(0\) is a 'user' turn"),
    ({"messages": [{"role": "robot", "content": "x"}]}, r"message 0 has role 'robot'"),
    ([1, 2], r"expected an object, got list"),
])
def test_bad_rows_are_refused_with_their_line(tmp_path, line, reason):
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps({"prompt": "ok", "response": "fine"}) + "\n\n" + json.dumps(line) + "\n")
    with pytest.raises(ValueError, match=rf"bad.jsonl:3: {reason}"):
        SFTDataModule(data_path=str(data), global_batch_size=1, split="1").setup("fit")


def test_jsonl_and_parquet_read_alike_and_bad_parquet_rows_name_the_row(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    rows = [{"prompt": f"p{i}", "response": f"r{i}", "system": None if i % 2 else "s"} for i in range(6)]
    jsonl = write_jsonl(tmp_path / "d.jsonl", [{k: v for k, v in r.items() if v is not None} for r in rows])
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    chats = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
             for i in range(3)]
    pq.write_table(pa.Table.from_pylist(chats), tmp_path / "chat.parquet")
    samples = {}
    for name in ("d.jsonl", "d.parquet", "chat.parquet"):
        dm = SFTDataModule(data_path=str(tmp_path / name), seq_length=40, global_batch_size=1, split="1")
        dm.setup("fit")
        samples[name] = sorted(tuple(dm.train_dataset[i]["labels"].tolist()) for i in range(len(dm.train_dataset)))
    assert samples["d.jsonl"] == samples["d.parquet"] and len(samples["d.jsonl"]) == 6
    assert len(samples["chat.parquet"]) == 3
    pq.write_table(pa.Table.from_pylist(rows[:2] + [{"prompt": "p", "response": None, "system": None}]),
                   tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match=r"bad.parquet, row 3: 'response' is missing"):
        SFTDataModule(data_path=str(tmp_path / "bad.parquet"), global_batch_size=1, split="1").setup("fit")


def test_tokenised_conversations_are_cached_and_rebuilt_when_the_data_or_the_format_changes(tmp_path):
    data = tmp_path / "d.jsonl"
    write_jsonl(data, [{"prompt": f"p{i}", "response": f"r{i}"} for i in range(4)])

    def samples(**kwargs):
        dm = SFTDataModule(data_path=str(data), seq_length=40, global_batch_size=1, split="1", **kwargs)
        dm.setup("fit")
        return dm, sorted(tuple(dm.train_dataset[i]["input_ids"].tolist()) for i in range(len(dm.train_dataset)))

    dm, first = samples()
    entries = list((tmp_path / "index_cache").iterdir())
    assert len(entries) == 1

    def refuse(conversation):
        raise AssertionError("tokenised again although cached")

    again = SFTDataModule(data_path=str(data), seq_length=40, global_batch_size=1, split="1")
    again.format.encode = refuse
    again.setup("fit")
    assert sorted(tuple(again.train_dataset[i]["input_ids"].tolist()) for i in range(4)) == first
    # another prompt style and another file content are other entries, whose samples say so
    _, styled = samples(prompt_style={"user": "Q: {content}\nA: "})
    assert bytes(styled[0][:4]) == b"Q: p" and len(list((tmp_path / "index_cache").iterdir())) == 2
    write_jsonl(data, [{"prompt": f"x{i}", "response": f"r{i}"} for i in range(4)])
    _, changed = samples()
    assert all(b"User: x" in bytes(t for t in row if t < 256) for row in changed)
    assert len(list((tmp_path / "index_cache").iterdir())) == 3


def rows_of(batch):
    return sorted(tuple(row) for row in torch.cat([batch["input_ids"], batch["labels"]], 1).tolist())


@pytest.mark.parametrize("packing", [False, True])
def test_global_batches_are_the_same_at_any_dp_and_resume_neither_repeats_nor_skips(packing):
    config = dict(seq_length=96, global_batch_size=8, packing=packing, split="90,10,0")
    single = attach(SFTDataModule(**config))
    single.setup("fit")
    pair = [attach(SFTDataModule(**config), 2, rank) for rank in range(2)]
    for dm in pair:
        dm.setup("fit")
    loaders = [single.train_dataloader()] + [dm.train_dataloader() for dm in pair]
    for loader in loaders:
        loader.sampler.set_epoch(1)
    iterators = [iter(loader) for loader in loaders]
    expected = []
    for step in range(5):
        batches = [next(it) for it in iterators]
        whole = rows_of(batches[0])
        assert len(whole) == 8 and whole == sorted(rows_of(batches[1]) + rows_of(batches[2])), step
        expected.append(whole)
        if step == 2:
            state = loaders[0].state_dict()  # the fit loop's record after three batches of epoch 1
    # resumed at dp=2 from the dp=1 run's record: the next global batches are those the straight run saw
    resumed = [attach(SFTDataModule(**config), 2, rank) for rank in range(2)]
    for dm in resumed:
        dm.setup("fit")
    loaders = [dm.train_dataloader() for dm in resumed]
    for loader in loaders:
        loader.load_state_dict(state)
    iterators = [iter(loader) for loader in loaders]
    for step in (3, 4):
        assert sorted(rows_of(next(iterators[0])) + rows_of(next(iterators[1]))) == expected[step], step
    # validation samples are held-out conversations only, and training samples differ per epoch only by order
    train_prompts = {c[:-1] for c in single.conversations("train")}
    assert len(train_prompts) == 1800 and not train_prompts & {turns for turns, _ in single.held_out("validation")}


def test_builtin_instructions_and_held_out_predict_prompts():
    conversations = instruction_set()
    assert conversations == instruction_set() and len(conversations) == 2000
    assert all(ANSWER_PATTERN.fullmatch(c[-1].content) for c in conversations)
    assert instruction_set(5) == conversations[:5]
    assert len({c[0].content for c in conversations}) == 2000  # no repeats: the held-out prompts are new
    dm = attach(SFTDataModule(seq_length=64, global_batch_size=4, predict_prompts="validation",
                              generation={"max_new_tokens": 8}))
    held_out = dm.held_out("validation")
    assert len(held_out) == 100 and all(ANSWER_PATTERN.fullmatch(answer) for _, answer in held_out)
    batch = next(iter(dm.predict_dataloader()))
    assert batch["generation"] == {"max_new_tokens": 8, "eos_id": EOS}
    # each prompt is its training text up to where the response starts
    for row, mask, (turns, answer) in zip(batch["input_ids"], batch["attention_mask"], held_out):
        prompt = row[mask.bool()].tolist()
        assert ByteTokenizer().decode(prompt) == f"User: {turns[0].content}\nAssistant: "
        full = dm.format.encode([*turns, Message("assistant", answer)])
        assert full.ids[: len(prompt)] == prompt and not any(full.trained[: len(prompt)])
        assert all(full.trained[len(prompt):])
    with pytest.raises(ValueError, match="must end with the assistant's response|where a 'user' turn belongs"):
        SFTDataModule(predict_prompts=[[{"role": "assistant", "content": "x"}]])


def test_check_model_refuses_a_small_vocabulary_or_context():
    dm = SFTDataModule(seq_length=64)
    dm.check_model(tiny_config())
    with pytest.raises(ValueError, match="tokenizer has 257 ids but the model's vocab_size is 100"):
        dm.check_model(tiny_config(vocab_size=100))
    with pytest.raises(ValueError, match="seq_length=64 exceeds the model's max_seq_length=32"):
        dm.check_model(tiny_config(max_seq_length=32))


def test_generate_asks_prompts_in_the_taught_format(hf_dir, tmp_path):
    """``lightning-megatron generate --prompt-style``: ``chat`` gives exactly the ids of the tokenizer's own template
    with its generation prompt; ``plain`` the style's user turn up to the response; ``chat`` with no tokenizer
    directory names the fix."""
    from lightning_megatron.data.tokenizers import load_tokenizer
    from lightning_megatron.commands.generate import choose_tokenizer, encode_prompts

    tokenizer = choose_tokenizer(hf_dir.chat, None, len(hf_dir.hf), prompt_style="chat")
    ids = encode_prompts(["hello world"], tokenizer, "chat")
    expected = hf_dir.hf.apply_chat_template([{"role": "user", "content": "hello world"}], tokenize=True,
                                             add_generation_prompt=True, return_dict=False)
    assert ids == [list(expected)] and tokenizer.eos_id == hf_dir.hf.eos_token_id
    byte = load_tokenizer("byte")
    assert encode_prompts(["Reverse cat."], byte, "plain") == [byte.encode("User: Reverse cat.\nAssistant: ")]
    with pytest.raises(ValueError, match="no tokenizer directory: pass --tokenizer DIR"):
        choose_tokenizer(None, tmp_path, 257, prompt_style="chat")


@pytest.mark.slow
def test_trainer_predict_over_the_validation_loader_gives_the_logits_of_its_samples(tmp_path):
    """``trainer.predict(model, dataloaders=dm.val_dataloader())``: Lightning rebuilds the loader for prediction
    (keeping a last partial batch); every validation sample is predicted, in order, as the model computes it."""
    import lightning as L

    from lightning_megatron.models import GPT

    L.seed_everything(3)
    model = GPT(tiny_config("llama"))
    dm = SFTDataModule(data_path=write_rows(tmp_path / "rows.jsonl", 40), seq_length=32, global_batch_size=4,
                       split="75,25,0")  # 10 validation samples: batches of 4, 4 and 2
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    dm.trainer = trainer
    dm.setup("fit")
    out = trainer.predict(model, dataloaders=dm.val_dataloader())
    logits = torch.cat([batch["logits"] for batch in out])
    samples = [dm.val_dataset[i] for i in range(len(dm.val_dataset))]
    assert logits.shape == (len(samples), 32, 257) and len(samples) % 4  # a last partial batch is predicted too
    with torch.no_grad():
        expected = torch.cat([model.predict_step({k: v[None] for k, v in s.items()})["logits"] for s in samples])
    torch.testing.assert_close(logits, expected)


def write_rows(path, count):
    return write_jsonl(path, [{"prompt": f"Say {i}.", "response": f"{i}"} for i in range(count)])


def test_a_small_held_out_split_is_told_a_split_that_gives_it_enough(tmp_path):
    """The warning and the error about a held-out split with too few samples suggest a split other than the one
    given, and that suggestion works."""
    data = write_rows(tmp_path / "rows.jsonl", 100)
    dm = attach(SFTDataModule(data_path=data, seq_length=32, global_batch_size=8))  # default split '95,5,0'
    dm.setup("fit")
    with pytest.warns(UserWarning, match=r"Give it a larger share than split='95,5,0' does \(e.g. split='95,10,0'\)"):
        dm.val_dataloader()
    dm = attach(SFTDataModule(data_path=data, seq_length=32, global_batch_size=8, split="95,10,0"))
    dm.setup("fit")
    assert dm.val_dataloader().batch_size == 8  # a whole global batch: no warning needed
    # at dp=4 one validation sample is too few: the error names a split that gives it 4
    with pytest.raises(ValueError, match=r"than split='99,1,0' does, e.g. split='99,5,0'"):
        attach(SFTDataModule(data_path=data, seq_length=32, global_batch_size=8, split="99,1,0"),
               dp_size=4).setup("fit")
    attach(SFTDataModule(data_path=data, seq_length=32, global_batch_size=8, split="99,5,0"), dp_size=4).setup("fit")
    # predicting the prompts of a split weighted 0 names a weight for it
    dm = attach(SFTDataModule(data_path=data, seq_length=32, global_batch_size=8, predict_prompts="test"))
    with pytest.raises(ValueError, match=r"gives that split no conversation; give it a weight, e.g. split='95,5,5'"):
        dm.predict_dataloader()
