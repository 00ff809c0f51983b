"""BERT on preprocessed data: a WordPiece tokenizer, sentences from --split-sentences, training with the strategy."""

import ast
import json
from types import SimpleNamespace

import lightning as L
import numpy as np
import pytest
import torch

from lightning_megatron import Megatron3DStrategy
from lightning_megatron.cli import main as cli_main
from lightning_megatron.data import BERTDataModule, stdlib_source_files
from lightning_megatron.data.bert import IndexedDocuments, SpecialTokens
from lightning_megatron.data.indexed import IndexedDataset
from lightning_megatron.data.preprocess import preprocess
from lightning_megatron.data.tokenizers import HFTokenizer, load_tokenizer
from lightning_megatron.models import BERT, BERTConfig

pytest.importorskip("tokenizers")
SEQ = 128


def _docstrings(max_files: int) -> list[str]:
    """English prose without a download: per stdlib module, its longer docstrings as one document."""
    texts = []
    for file in stdlib_source_files(max_files=max_files):
        nodes = ast.walk(ast.parse(file.read_text()))
        docstrings = [ast.get_docstring(node) or "" for node in nodes
                      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef))]
        text = "\n\n".join(doc for doc in docstrings if len(doc) > 200)
        if len(text) > 1000:
            texts.append(text)
    return texts


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Docstrings as .jsonl, a WordPiece tokenizer trained on them by the CLI, and the data split into sentences."""
    folder = tmp_path_factory.mktemp("bert_indexed")
    texts = _docstrings(max_files=80)
    (folder / "docs.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    cli_main(["train-tokenizer", "--model", "wordpiece", "--lowercase", "--input", str(folder / "docs.jsonl"),
              "--vocab-size", "1000", "--output", str(folder / "wordpiece.json")])
    cli_main(["preprocess", "--input", str(folder / "docs.jsonl"), "--tokenizer", str(folder / "wordpiece.json"),
              "--output-prefix", str(folder / "docs"), "--split-sentences", "--append-eos", "--no-progress"])
    return SimpleNamespace(folder=folder, texts=texts, tokenizer=folder / "wordpiece.json", prefix=str(folder / "docs"))


def _set_up(datamodule, dp_size=1):
    datamodule.trainer = SimpleNamespace(strategy=SimpleNamespace(
        distributed_sampler_kwargs={"num_replicas": dp_size, "rank": 0}))
    datamodule.setup("fit")
    return datamodule


@pytest.mark.slow
def test_wordpiece_tokenizer_has_berts_special_tokens(corpus):
    tok = load_tokenizer(str(corpus.tokenizer))
    assert isinstance(tok, HFTokenizer) and tok.vocab_size == 1000
    assert (tok.pad_id, tok.cls_id, tok.sep_id, tok.mask_id) == (0, 2, 3, 4) and tok.special_ids == {0, 1, 2, 3, 4}
    assert tok.eos_token == "[SEP]" and tok.eos_id == 3  # WordPiece data separates documents with [SEP]
    assert tok.decode(tok.encode("The Return value, e.g. None.")) == "the return value, e. g. none."
    metadata = json.loads(open(f"{corpus.prefix}.meta.json").read())
    assert metadata["split_sentences"] and metadata["append_eos"] and metadata["eos_id"] == 3


def test_a_tokenizer_json_saved_by_transformers_gives_the_same_ids(tmp_path):
    transformers = pytest.importorskip("transformers")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "cat", "sat", "on", "mat", "##s", "."]
    (tmp_path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    bert = transformers.BertTokenizerFast(str(tmp_path / "vocab.txt"))
    bert.save_pretrained(str(tmp_path))
    tok = load_tokenizer(str(tmp_path / "tokenizer.json"))
    assert (tok.pad_id, tok.cls_id, tok.sep_id, tok.mask_id, tok.eos_id) == (0, 2, 3, 4, 3)
    text = "The cats sat on the mat."
    assert tok.encode(text) == bert(text, add_special_tokens=False)["input_ids"] == [5, 6, 10, 7, 8, 5, 9, 11]
    assert SpecialTokens.of_tokenizer(tok) == SpecialTokens(0, 2, 3, 4, vocab_size=12, other_special_ids=(1,))


@pytest.mark.slow
def test_samples_are_cls_a_sep_b_sep_with_segments_at_sentence_boundaries(corpus):
    dm = _set_up(BERTDataModule(data_prefix=corpus.prefix, seq_length=SEQ, global_batch_size=8, split="90,10,0"))
    special, dataset = dm.special_tokens, dm.train_dataset
    assert (special.cls_id, special.sep_id, special.mask_id, dm.vocab_size) == (2, 3, 4, 1000)
    assert isinstance(dataset.documents, IndexedDocuments)  # read per sample from the memory-mapped .bin
    # From the .idx: where every document's sentences start, and its end without the end-of-document [SEP]. A
    # window holds whole sentences; a sentence longer than a window is cut into window-long pieces first.
    data, span = IndexedDataset(corpus.prefix), SEQ - 3
    sentence_starts, piece_starts, document_ends = [], [], []
    for d in range(data.num_documents):
        lengths = data.sequence_lengths[data.document_indices[d] : data.document_indices[d + 1]]
        offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        sentence_starts.append(set(offsets.tolist()))
        piece_starts.append({int(o) + k for o, n in zip(offsets, lengths) for k in range(0, int(n), span)})
        document_ends.append(int(lengths.sum()) - 1)
    checked = at_sentence_start = with_two_sentences = 0
    for index in range(0, len(dataset), 3):
        sample = dataset[index]
        document, start, length = (int(x) for x in dataset.windows[index])
        starts, end = sentence_starts[document], start + length
        assert start in piece_starts[document] and (end in piece_starts[document] or end == document_ends[document])
        at_sentence_start += start in starts
        ids, labels = sample["input_ids"].numpy(), sample["labels"].numpy()
        real = int(sample["attention_mask"].sum())
        assert ids[0] == special.cls_id and ids[real - 1] == special.sep_id and (ids[real:] == special.pad_id).all()
        first_sep = int(np.flatnonzero(ids == special.sep_id)[0])
        assert (ids == special.sep_id).sum() == 2 and real == length + 3  # no end-of-document [SEP] inside
        assert (sample["token_type_ids"].numpy()[:real] == (np.arange(real) > first_sep)).all()
        original = np.where(labels != -100, labels, ids)  # masked positions hold their label
        a, b = original[1:first_sep], original[first_sep + 1 : real - 1]
        first, second = (b, a) if sample["sentence_order_label"] else (a, b)
        assert np.array_equal(np.concatenate([first, second]), data.document(document)[start:end])
        if any(start < s < end for s in starts):  # a sentence starts inside: B starts at one of them
            assert start + len(first) in starts
            with_two_sentences += 1
        replaced = (labels != -100) & (ids != special.mask_id) & (ids != labels)
        assert (ids[replaced] >= 5).all(), "random replacements are ordinary ids"
        checked += 1
    print(f"{checked} samples: {at_sentence_start} start at a sentence, {with_two_sentences} hold two or more")
    # the rest: pieces of sentences longer than a window (code in docstrings), or single sentences that fill one
    assert at_sentence_start > 0.75 * checked and with_two_sentences > 0.6 * checked and checked > 50


@pytest.mark.slow
def test_unsplit_indexed_data_cuts_fixed_windows_anywhere(corpus, tmp_path):
    preprocess(input=corpus.folder / "docs.jsonl", tokenizer=str(corpus.tokenizer), output_prefix=tmp_path / "plain",
               progress=False)
    dm = _set_up(BERTDataModule(data_prefix=str(tmp_path / "plain"), seq_length=SEQ, global_batch_size=8))
    dataset, data = dm.train_dataset, IndexedDataset(tmp_path / "plain")
    assert len(data) == data.num_documents  # one sequence per document
    lengths = [len(data.document(d)) for d in dm.train_dataset.documents.documents]
    assert dataset.windows.tolist() == [[d, s, min(SEQ - 3, n - s)] for d, n in enumerate(lengths)
                                        for s in range(0, n, SEQ - 3) if n - s >= 2]
    assert dataset[3]["input_ids"].shape == (SEQ,)


@pytest.mark.slow
def test_bert_trains_on_wordpiece_sentences_with_the_strategy(corpus):
    dm = BERTDataModule(data_prefix=corpus.prefix, seq_length=SEQ, global_batch_size=8, split="95,5,0", seed=3)
    config = BERTConfig(vocab_size=dm.vocab_size, max_seq_length=SEQ, hidden_size=64, num_layers=2, num_heads=4)
    model = BERT(config, learning_rate=5e-3, warmup_steps=2, adam_eps=1e-6)
    losses = []

    class RecordLosses(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))

    L.seed_everything(7)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=Megatron3DStrategy(), max_steps=16,
                        limit_val_batches=2, val_check_interval=16, num_sanity_val_steps=0, gradient_clip_val=1.0,
                        callbacks=[RecordLosses()], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, datamodule=dm)
    print("losses", [round(loss, 3) for loss in losses])
    assert len(losses) == 16 and all(np.isfinite(losses))
    assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.5, losses
    assert np.isfinite(float(trainer.callback_metrics["val_loss"]))


@pytest.mark.slow
def test_tokenizers_without_berts_special_tokens_are_refused(corpus, tmp_path):
    cli_main(["train-tokenizer", "--input", str(corpus.folder / "docs.jsonl"), "--vocab-size", "300",
              "--output", str(tmp_path / "bpe.json")])
    preprocess(input=corpus.folder / "docs.jsonl", tokenizer=str(tmp_path / "bpe.json"), output_prefix=tmp_path / "bpe",
               progress=False)
    with pytest.raises(ValueError, match=r"bpe\.json has no \[PAD\], \[CLS\], \[SEP\], \[MASK\] token; BERT's samples "
                                         r"need .*--model wordpiece"):
        BERTDataModule(data_prefix=str(tmp_path / "bpe"))
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {token: i for i, token in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "the", "cat"])}
    no_mask = tokenizers.Tokenizer(tokenizers.models.WordPiece(vocab, unk_token="[UNK]"))
    no_mask.pre_tokenizer = tokenizers.pre_tokenizers.BertPreTokenizer()
    no_mask.save(str(tmp_path / "no_mask.json"))
    preprocess(input=corpus.folder / "docs.jsonl", tokenizer=str(tmp_path / "no_mask.json"),
               output_prefix=tmp_path / "no_mask_data", progress=False)
    with pytest.raises(ValueError, match=r"no_mask\.json has no \[MASK\] token"):
        BERTDataModule(data_prefix=str(tmp_path / "no_mask_data"))


@pytest.mark.slow
def test_data_module_argument_errors(corpus):
    with pytest.raises(ValueError, match=r"tokenizer='byte' has 257 ids but data_prefix=.* was made with"):
        BERTDataModule(data_prefix=corpus.prefix, tokenizer="byte")
    with pytest.raises(ValueError, match=r"built-in corpus is byte-tokenised; tokenizer='bert\.json' needs"):
        BERTDataModule(tokenizer="bert.json")
    with pytest.raises(ValueError, match=r"max_files=3 selects files of the built-in corpus"):
        BERTDataModule(data_prefix=corpus.prefix, max_files=3)
    with pytest.raises(FileNotFoundError, match=r"No indexed dataset at data_prefix="):
        BERTDataModule(data_prefix=corpus.prefix + "_missing")
    dm = BERTDataModule(data_prefix=corpus.prefix, seq_length=SEQ)
    dm.trainer = SimpleNamespace(strategy=None, lightning_module=SimpleNamespace(config=BERTConfig()))
    with pytest.raises(ValueError, match=r"vocab_size=261 is smaller than the 1000 ids of the tokenizer .*wordpiece"):
        dm.setup("fit")
    assert torch.is_tensor(_set_up(dm).train_dataset[0]["input_ids"])
