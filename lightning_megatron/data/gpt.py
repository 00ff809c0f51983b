"""GPT pre-training data: indexed datasets (one, or a weighted blend) of any size, split over dp ranks.

Every corpus goes through :class:`~lightning_megatron.data.gpt_dataset.GPTDataset`: a
preprocessed ``data_prefix``, a Megatron-LM blend of several, and the built-in stdlib corpus
(written once as an indexed dataset into the cache), so small data is not a separate path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

from torch.utils.data import DataLoader, Dataset

from lightning_megatron.data.base import TokenDataModule
from lightning_megatron.data.blend import BlendedDataset, parse_data_prefix, samples_per_dataset
from lightning_megatron.data.corpus import index_cache_dir, stdlib_indexed_corpus
from lightning_megatron.data.gpt_dataset import DocumentMasks, GPTDataset
from lightning_megatron.data.index_cache import Ranks
from lightning_megatron.data.indexed import IndexedDataset
from lightning_megatron.data.preprocess import load_dataset_tokenizer, read_metadata
from lightning_megatron.data.prompts import PromptDataset
from lightning_megatron.data.tokenizers import Tokenizer, load_tokenizer

_SPLIT_SEEDS = {"train": 0, "validation": 1, "test": 2}  # each split's samples are shuffled by its own stream


class GPTDataModule(TokenDataModule):
    """Next-token prediction on preprocessed indexed datasets, or by default on the Python standard
    library's source, byte-tokenised.

    Args:
        seq_length: tokens per sample.
        global_batch_size: samples per optimizer step summed over all data-parallel ranks;
            each rank loads ``global_batch_size // data_parallel_size`` of them.
        split: Megatron-LM's train, validation and test weights, ``"969,30,1"`` by default:
            contiguous document ranges of each dataset, so the three never share a document.
        max_files: use only the first ``max_files`` stdlib files (all when ``None``); built-in
            corpus only.
        seed: seed of the document orders and sample orders.
        num_workers: DataLoader worker processes.
        data_prefix: a Megatron-LM indexed dataset ``PREFIX.bin``/``PREFIX.idx`` (written by
            ``lightning-megatron preprocess`` or Megatron-LM's tools), or a weighted blend in
            Megatron-LM's form ``[0.3, "data/a", 0.7, "data/b"]`` (also as a YAML list). The
            ``.bin`` is never read whole: a rank reads only the samples it loads.
        tokenizer: ``"byte"`` or a ``tokenizer.json``: the tokenizer the data was made with,
            which gives :attr:`vocab_size` and the end-of-document id. By default the one that
            ``preprocess`` recorded in ``PREFIX.meta.json`` (``"byte"`` for the built-in corpus);
            needed for indexed data made by other tools.
        reset_position_ids, reset_attention_mask, eod_mask_loss: Megatron-LM's per-document
            masks of packed samples (see ``data/gpt_dataset.py``); all off by default.
        index_cache_dir: where the index arrays are cached; by default ``index_cache`` next
            to the (first) dataset, or under ``$LIGHTNING_MEGATRON_CACHE`` when that directory
            is not writable.
        predict_prompts: text (or token-id lists) for ``trainer.predict``: ``GPT.predict_step``
            continues each (``data/prompts.py``), with the ``generation`` settings
            (``{"max_new_tokens": 32, "temperature": 0.0, ...}``; ``eos_id`` defaults to the
            tokenizer's). Predicting opens no corpus.

    Example::

        trainer.fit(model, datamodule=GPTDataModule(seq_length=256, global_batch_size=32))
        # after `lightning-megatron preprocess --input corpus.jsonl --tokenizer byte --output-prefix data/corpus`
        trainer.fit(model, datamodule=GPTDataModule(data_prefix="data/corpus"))
        trainer.fit(model, datamodule=GPTDataModule(data_prefix=[0.3, "data/code", 0.7, "data/web"]))

    The training set holds as many samples as the run draws (Megatron-LM's ``train_samples``:
    ``max_steps * global_batch_size``), over as many data epochs as needed, each with its own
    document order; without ``max_steps`` it holds one data epoch, reshuffled every epoch by
    the sampler. Every loader gets a :class:`~torch.utils.data.DistributedSampler` built
    here, even at dp=1: rank r takes every dp-th sample of the one order, so the dp ranks'
    batches at step k together are exactly the dp=1 batch at step k, and a run resumes
    mid-epoch at any dp (``data/resumable.py``).
    """

    def __init__(
        self,
        *,
        seq_length: int = 128,
        global_batch_size: int = 16,
        split: str = "969,30,1",
        max_files: Optional[int] = None,
        seed: int = 1234,
        num_workers: int = 0,
        data_prefix: Optional[Union[str, list[Union[str, float]]]] = None,
        tokenizer: Optional[str] = None,
        reset_position_ids: bool = False,
        reset_attention_mask: bool = False,
        eod_mask_loss: bool = False,
        index_cache_dir: Optional[str] = None,
        predict_prompts: Optional[list[Union[str, list[int]]]] = None,
        generation: Optional[dict] = None,
    ) -> None:
        super().__init__(global_batch_size=global_batch_size, split=split, seed=seed, num_workers=num_workers)
        self.check_data_choice(max_files=max_files, data_prefix=data_prefix, tokenizer=tokenizer)
        if seq_length < 1:
            raise ValueError(f"seq_length must be at least 1, got {seq_length}.")
        self.seq_length = seq_length
        self.max_files = max_files
        self.data_prefix = data_prefix
        self.masks = DocumentMasks(reset_position_ids, reset_attention_mask, eod_mask_loss)
        self.index_cache_dir = index_cache_dir
        self.prefixes, self.weights = parse_data_prefix(data_prefix) if data_prefix is not None else ([], [1.0])
        self.tokenizer = self._load_tokenizer(tokenizer)
        self._corpora: list[IndexedDataset] = []
        self.prompts = PromptDataset(predict_prompts, self.tokenizer, generation) if predict_prompts else None

    def _load_tokenizer(self, spec: Optional[str]) -> Tokenizer:
        """The tokenizer the data was made with: ``spec``, else the one ``preprocess`` recorded (the same for
        every dataset of a blend)."""
        if not self.prefixes:
            return load_tokenizer("byte")
        tokenizers = [load_dataset_tokenizer(prefix, spec) for prefix in self.prefixes]
        if spec is None and len(self.prefixes) > 1:
            named = {prefix: read_metadata(prefix)["tokenizer"] for prefix in self.prefixes}
            if len(set(named.values())) > 1:
                raise ValueError(f"The blended datasets were made with different tokenizers ({named}); a model "
                                 f"trains on one vocabulary: preprocess them with the same tokenizer.")
        return tokenizers[0]

    def data_source(self) -> str:
        return f"max_files={self.max_files}" if self.data_prefix is None else f"data_prefix={self.data_prefix!r}"

    # ------------------------------------------------------------------ corpus and datasets
    @property
    def ranks(self) -> Ranks:
        return Ranks.of_trainer(self.trainer)

    def open_corpus(self) -> int | list[int]:
        if not self.prefixes:
            self.prefixes = [stdlib_indexed_corpus(self.max_files, ranks=self.ranks)]
        self._corpora = [IndexedDataset(prefix) for prefix in self.prefixes]
        counts = [corpus.num_documents for corpus in self._corpora]
        return counts if len(counts) > 1 else counts[0]

    def cache_dir(self) -> Path:
        """``index_cache_dir``, else ``index_cache`` beside the first dataset when that is writable, else the user
        cache."""
        return index_cache_dir(self.prefixes[0], self.index_cache_dir)

    def _gpt_dataset(self, d: int, documents: range, num_samples: Optional[int], split: str) -> GPTDataset:
        name = f"{Path(self.prefixes[d]).name} ({split})"
        return GPTDataset(self._corpora[d], documents, seq_length=self.seq_length, num_samples=num_samples,
                          seed=self.seed * 3 + _SPLIT_SEEDS[split], eos_id=self.tokenizer.eos_id,
                          cache_dir=self.cache_dir(), ranks=self.ranks, masks=self.masks,
                          vocab_size=self.vocab_size, name=name)

    def make_dataset(self, split: str, documents: range | list[range], num_samples: Optional[int]) -> Dataset:
        if not isinstance(documents, list):
            return self._gpt_dataset(0, documents, num_samples, split)
        if num_samples is None:  # one pass: as many samples as all the datasets' epochs hold
            num_samples = sum(len(self._gpt_dataset(d, docs, None, split)) for d, docs in enumerate(documents) if docs)
        present = [d for d, docs in enumerate(documents) if docs]
        weights = [self.weights[d] for d in present]
        dataset_index, dataset_sample = BlendedDataset.index(weights, num_samples, cache_dir=self.cache_dir(),
                                                             ranks=self.ranks)
        needed = samples_per_dataset(dataset_index, len(present))
        parts = [self._gpt_dataset(d, documents[d], count, split) for d, count in zip(present, needed)]
        return BlendedDataset(parts, [self.prefixes[d] for d in present], dataset_index, dataset_sample)

    def train_dataloader(self):
        self._train_loader = super().train_dataloader()
        return self._train_loader

    def predict_dataloader(self) -> DataLoader:
        """The prompts, in order, ``per_rank_batch_size`` at a time (Lightning splits them over dp)."""
        if self.prompts is None:
            raise ValueError("trainer.predict needs prompts: GPTDataModule(predict_prompts=['...'], generation="
                             "{'max_new_tokens': 32}) (or --data.predict_prompts on the command line).")
        return DataLoader(self.prompts, batch_size=self.per_rank_batch_size, collate_fn=self.prompts.collate,
                          shuffle=False)

    def consumed_tokens(self) -> dict[str, int]:
        """Tokens each blended dataset has given to training so far (empty for one dataset), read from the
        training loader's position (restored on resume) and the blend index: the same on every rank, with no
        communication. GPT and BERT log them as ``consumed_tokens/<dataset>``."""
        loader = getattr(self, "_train_loader", None)
        if not isinstance(self.train_dataset, BlendedDataset) or loader is None:
            return {}
        state = loader.state_dict()
        blend = self.train_dataset
        now = blend.sample_counts(state["consumed_batches"] * self.global_batch_size)
        return {Path(name).name: (state["epoch"] * blend.totals[name] + now[name]) * self.seq_length for name in now}
