"""``HFCausalLM``'s modules (transformers' own layers) trained under several layouts over the same processes, as
``layout_invariance`` trains the GPT: ``main(out_dir, [LAYOUTS, DIRECTORY])``, each layout ``{family}-{layout words}``
(``hf_causal_setup.FAMILIES``; the words are ``layout_invariance``'s), the family's ``save_pretrained`` directory
``DIRECTORY/{family}``, read by every rank for its own shards. Rank 0 writes ``{layout}.pt`` (losses, gathered
weights)."""

from functools import partial
from pathlib import Path

from entry import run_script
from hf_causal_setup import FAMILIES
from layout_invariance import build, train
from layout_runs import layouts_job
from lightning_megatron.models.hf_causal_lm import SafetensorsWeights, build_causal_lm, read_config


def train_family(out_dir: Path, directory: Path, layout: str):
    family, words = layout.split("-", 1)
    assert family in FAMILIES, f"{layout}: {family!r} is no family of hf_causal_setup"
    source = directory / family
    make = partial(build_causal_lm, read_config(source), weights=SafetensorsWeights(source))
    return train(out_dir, words, build_model=partial(build, make_model=make))


def main(out_dir: Path, args: list[str]) -> None:
    layouts_job(out_dir, args[0].split(","), partial(train_family, out_dir, Path(args[1])))


if __name__ == "__main__":
    run_script(main)
