"""Which tokens of a chat-templated conversation are trained (``data/chat_templates.py``): with ``{% generation %}``
markers exactly those transformers' ``return_assistant_tokens_mask`` marks, through the SFT data's labels whole,
cut and packed; without markers the prefix rule, whose difference on ChatML (the ``\\n`` after ``<|im_end|>``) is
shown; templates whose markers cannot be used are refused, naming the fix."""

import functools
import json
import random
import re
from pathlib import Path

import pytest

from lightning_megatron.data import SFTDataModule
from lightning_megatron.data.chat_templates import has_generation_markers
from lightning_megatron.data.conversations import Message

transformers = pytest.importorskip("transformers")

# ChatML as Qwen writes it, the assistant's content and <|im_end|> in a generation block and the "\n" after it outside
CHATML_MARKED = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}"
    "{% else %}{{ m['content'] }}<|im_end|>{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CHATML = CHATML_MARKED.replace("{% generation %}", "").replace("{% endgeneration %}", "")
# Llama 3's layout: a bos, headers, each turn ended by <|eot_id|> with nothing after it; whitespace-controlled markers
LLAMA3_MARKED = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>{{ '\\n\\n' }}"
    "{%- if m['role'] == 'assistant' %}{%- generation -%}{{ m['content'] | trim }}<|eot_id|>{%- endgeneration -%}"
    "{% else %}{{ m['content'] | trim }}<|eot_id|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
LLAMA3 = LLAMA3_MARKED.replace("{%- generation -%}", "").replace("{%- endgeneration -%}", "")
SPECIAL = ["<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
WORDS = "hello world again yes sir answer the letters of cat tac sort add two and five seven short be".split()


def random_conversations(count, seed=0):
    """``count`` chats of 1-3 turns, a system prompt in about half, words with an occasional newline inside."""
    rng = random.Random(seed)

    def text():
        return " ".join(rng.choice(WORDS) + ("\n" if rng.random() < 0.1 else "") for _ in range(rng.randint(1, 5)))

    chats = []
    for _ in range(count):
        chat = [{"role": "system", "content": text()}] if rng.random() < 0.5 else []
        for _ in range(rng.randint(1, 3)):
            chat += [{"role": "user", "content": text()}, {"role": "assistant", "content": text()}]
        chats.append(chat)
    return chats


CHATS = random_conversations(64)


def save_tokenizer(directory, template, eos_token, bos_token=None):
    """A small byte-level BPE with the templates' special tokens, saved as a fast tokenizer with ``template``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([" ".join(WORDS) + " user assistant system\n"] * 20, trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=eos_token, bos_token=bos_token)
    fast.chat_template = template
    fast.save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat_templates")
    return {"marked": save_tokenizer(root / "marked", CHATML_MARKED, "<|im_end|>"),
            "plain": save_tokenizer(root / "plain", CHATML, "<|im_end|>"),
            "llama3": save_tokenizer(root / "llama3", LLAMA3_MARKED, "<|eot_id|>", "<|begin_of_text|>"),
            "llama3_plain": save_tokenizer(root / "llama3_plain", LLAMA3, "<|eot_id|>", "<|begin_of_text|>")}


@functools.lru_cache
def load(directory):
    return transformers.AutoTokenizer.from_pretrained(directory)


def reference(directory, chat):
    """transformers' own ids and assistant mask of ``chat``."""
    out = load(directory).apply_chat_template(chat, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    return list(out["input_ids"]), [bool(m) for m in out["assistant_masks"]]


def expected_labels(ids, mask):
    """The target of position i is token i + 1: its id where transformers marks it, -100 elsewhere."""
    return [t if m else -100 for t, m in zip(ids[1:], mask[1:])]


def datamodule(directory, data_path, tmp_path, **options):
    dm = SFTDataModule(data_path=data_path, tokenizer=directory, global_batch_size=1, split="1",
                       index_cache_dir=str(tmp_path / "cache"), **options)
    dm.setup("fit")
    return dm


@pytest.fixture()
def data_path(tmp_path):
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": chat}) + "\n" for chat in CHATS))
    return str(path)


@pytest.mark.parametrize("template", ["marked", "llama3"])
def test_generation_markers_train_exactly_what_transformers_marks(dirs, template, data_path, tmp_path, caplog):
    """64 random conversations: every sample's trained labels are transformers' ``assistant_masks`` (same ids), one
    conversation per sample, and cut to a short window and packed (each document of a packed sample is its
    conversation's start); ChatML's "\\n" after <|im_end|> is never trained, every turn's end marker is."""
    directory = dirs[template]
    references = {json.dumps(chat): reference(directory, chat) for chat in CHATS}
    longest = max(len(ids) for ids, _ in references.values())
    with caplog.at_level("INFO"):
        dm = datamodule(directory, data_path, tmp_path, seq_length=longest)
    assert dm.format.marked and "trained where its {% generation %} blocks mark" in caplog.text
    samples = [dm.train_dataset[i] for i in range(len(dm.train_dataset))]
    assert len(samples) == len(CHATS)
    tokenizer = dm.tokenizer.hf
    end, newline = tokenizer.eos_token_id, tokenizer.encode("\n", add_special_tokens=False)
    assert len(newline) == 1
    for sample, conversation in zip(samples, dm.conversations("train")):
        chat = [{"role": m.role, "content": m.content} for m in conversation]
        ids, mask = references[json.dumps(chat)]
        padding = longest + 1 - len(ids)
        assert sample["input_ids"].tolist() == (ids + [end] * padding)[:-1]
        labels = sample["labels"].tolist()
        assert labels == expected_labels(ids, mask) + [-100] * padding
        turns = sum(m["role"] == "assistant" for m in chat)
        assert sum(1 for t in labels if t == end) == turns  # every turn's end marker is trained
        if template == "marked":  # the "\n" after each <|im_end|> is not
            after_end = [labels[i] for i in range(len(ids) - 1) if ids[i] == end and ids[i + 1] == newline[0]]
            assert len(after_end) == len(chat) and set(after_end) == {-100}

    # cut to a window of 65 tokens and packed: each document is its conversation's start, labelled as transformers
    # marks it, its last token's target (the next document's first) untrained
    seq_length = 64
    with pytest.warns(UserWarning, match=r"truncated \(their ends cut\), 0 dropped"):
        dm = datamodule(directory, data_path, tmp_path, seq_length=seq_length, packing=True, overlong="truncate")
    by_start = {tuple(ids[: seq_length + 1]): (ids, mask) for ids, mask in references.values()}
    documents, cut = 0, 0
    for i in range(len(dm.train_dataset)):
        sample = dm.train_dataset[i]
        tokens, labels, document = (sample[key].tolist() for key in ("input_ids", "labels", "document_ids"))
        for d in sorted(set(document)):
            start, stop = document.index(d), len(document) - document[::-1].index(d)
            matches = [key for key in by_start if key[: stop - start] == tuple(tokens[start:stop])]
            if not matches:  # the padding after the last conversation
                assert set(tokens[start:stop]) == {end} and set(labels[start:stop]) == {-100}
                continue
            ids, mask = by_start[matches[0]]
            length = min(len(ids), seq_length + 1)  # in the window
            full = expected_labels(ids, mask)
            assert labels[start:stop] == [full[k] if k + 1 < length else -100 for k in range(stop - start)]
            documents, cut = documents + 1, cut + (length < len(ids))
    assert documents == len(dm.train_dataset.conversations) > len(dm.train_dataset) and cut > 0


def test_without_markers_the_prefix_rule_also_trains_what_follows_each_end_marker(dirs):
    """The prefix rule (no markers) on the same 64 conversations gives the same ids; its trained tokens are
    transformers' marked ones and, with ChatML, the "\\n" after each assistant turn's <|im_end|> (the documented
    difference, in every conversation); with Llama 3's layout, which writes nothing after <|eot_id|>, the same."""
    for plain, marked, differing in (("plain", "marked", len(CHATS)), ("llama3_plain", "llama3", 0)):
        dm = SFTDataModule(tokenizer=dirs[plain])
        assert not dm.format.marked
        newline = dm.tokenizer.hf.encode("\n", add_special_tokens=False)[0]
        differ = 0
        for chat in CHATS:
            ids, mask = reference(dirs[marked], chat)
            encoded = dm.format.encode([Message(m["role"], m["content"]) for m in chat])
            assert list(encoded.ids) == ids
            with_newline = [m or (i > 0 and mask[i - 1] and ids[i] == newline) for i, m in enumerate(mask)]
            assert list(encoded.trained) == with_newline
            differ += with_newline != mask
        assert differ == differing, plain


def test_markers_are_found_in_the_template_source_and_unusable_ones_are_refused(dirs, tmp_path):
    chat = [Message("user", "hello"), Message("assistant", "world")]
    assert has_generation_markers(CHATML_MARKED) and has_generation_markers(LLAMA3_MARKED)
    assert not has_generation_markers(CHATML)
    # a marker in a comment, a raw block or a string is no marker
    for inert in ("{# {% generation %} #}", "{% raw %}{% generation %}{% endraw %}", "{{ '{% generation %}' }}"):
        assert not has_generation_markers(inert + CHATML)
    tokenizer = transformers.AutoTokenizer.from_pretrained(dirs["marked"])

    def with_template(name, template):
        tokenizer.chat_template = template
        tokenizer.save_pretrained(tmp_path / name)
        return SFTDataModule(tokenizer=str(tmp_path / name))

    # of several named templates, the one transformers renders with ("default") decides
    assert with_template("named", {"default": CHATML_MARKED, "other": CHATML}).format.marked
    assert not with_template("named_plain", {"default": CHATML, "other": CHATML_MARKED}).format.marked
    # markers that mark nothing (a role no message has)
    dm = with_template("nothing", CHATML_MARKED.replace("== 'assistant'", "== 'bot'"))
    with pytest.raises(ValueError, match=r"mark none of the tokens.*put \{% generation %\} before"):
        dm.format.encode(chat)
    # a block that ends before <|im_end|>: the model would not learn to stop
    outside = CHATML_MARKED.replace("<|im_end|>{% endgeneration %}", "{% endgeneration %}<|im_end|>")
    dm = with_template("no_end", outside)
    with pytest.raises(ValueError, match=r"marks 'world'.*without the end-of-sequence token '<\|im_end\|>'"):
        dm.format.encode(chat)
    # a slow tokenizer has no offsets to find the marked tokens by
    slow = transformers.ByT5Tokenizer()
    slow.chat_template = CHATML_MARKED
    slow.save_pretrained(tmp_path / "slow")
    dm = SFTDataModule(tokenizer=str(tmp_path / "slow"))
    with pytest.raises(ValueError, match=r"slow tokenizer ByT5Tokenizer.*fast tokenizer.*or remove the markers"):
        dm.format.encode(chat)
    # whose prompts, which need no marks, are written as transformers writes them
    assert dm.format.prompt(chat[:1]) == slow.apply_chat_template([{"role": "user", "content": "hello"}],
                                                                   add_generation_prompt=True, return_dict=False)


def test_the_docs_templates_render_alike_and_train_as_drawn(dirs, tmp_path):
    """docs/chat_templates.md's ChatML without and with markers: the same text; the marked one trains the response
    and its <|im_end|>, the other the "\\n" after it too, as its drawing says."""
    doc = (Path(__file__).parents[1] / "docs" / "chat_templates.md").read_text()
    templates = [block.rstrip("\n") for block in re.findall(r"```jinja\n(.*?)```", doc, re.S)]
    assert len(templates) == 2
    chat = [Message("user", "Reverse cat."), Message("assistant", "Answer: tac")]
    tokenizer = transformers.AutoTokenizer.from_pretrained(dirs["plain"])
    trained = []
    for name, template in zip(("without", "with"), templates):
        tokenizer.chat_template = template
        tokenizer.save_pretrained(tmp_path / name)
        encoded = SFTDataModule(tokenizer=str(tmp_path / name)).format.encode(chat)
        text = tokenizer.decode(encoded.ids, skip_special_tokens=False)
        assert text == "<|im_start|>user\nReverse cat.<|im_end|>\n<|im_start|>assistant\nAnswer: tac<|im_end|>\n"
        trained.append(tokenizer.decode([i for i, t in zip(encoded.ids, encoded.trained) if t],
                                        skip_special_tokens=False))
    assert trained == ["Answer: tac<|im_end|>\n", "Answer: tac<|im_end|>"]
