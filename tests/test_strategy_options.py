"""``Megatron3DStrategy``'s arguments are spelled twice: its flat keyword signature (LightningCLI builds ``init_args``
from it, and configs write ``init_args: tensor_parallel_size: ...``) and the fields of ``StrategyOptions``, which
check and document them. These tests hold the two spellings equal and the documentation where LightningCLI reads it.
"""

from __future__ import annotations

import inspect
from dataclasses import fields, replace

import pytest
from docstring_parser import parse

from lightning_megatron import Megatron3DStrategy
from lightning_megatron.offload.settings import OffloadSettings
from lightning_megatron.strategy.options import StrategyOptions

LIGHTNINGS = ("accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin")


def test_the_strategy_takes_exactly_the_options_fields_with_their_defaults_types_and_kinds():
    strategy = [p for p in inspect.signature(Megatron3DStrategy).parameters.values() if p.name not in LIGHTNINGS]
    options = list(inspect.signature(StrategyOptions).parameters.values())
    assert [p.name for p in strategy] == [f.name for f in fields(StrategyOptions) if f.init]
    assert [(p.name, p.default, p.annotation, p.kind) for p in strategy] == \
        [(p.name, p.default, p.annotation, p.kind) for p in options]
    assert [p.name for p in strategy][:5] == ["tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size",
                                              "sequence_parallel", "zero_stage"]  # positional, as before
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in strategy[5:])


def test_every_argument_is_documented_where_lightning_cli_reads_it():
    """The fields' documentation is the strategy's docstring: LightningCLI's ``--help`` parses it into one help
    line per argument."""
    documented = {param.arg_name: " ".join(param.description.split()) for param in parse(Megatron3DStrategy.__doc__).params}
    for option in fields(StrategyOptions):
        if option.init:
            assert documented.pop(option.name) == " ".join(option.metadata["doc"].split()), option.name
    assert documented == {}


def test_the_strategy_keeps_every_argument_given():
    strategy = Megatron3DStrategy(2, pipeline_parallel_size=1, zero_stage=1, fp8="tensorwise", fp8_exclude=["blocks.0.*"],
                                  offload_optimizer=True, verify_checkpoint=True, loss_scaler={"initial_scale": 8.0})
    assert strategy.options == StrategyOptions(2, zero_stage=1, fp8="tensorwise", fp8_exclude=("blocks.0.*",),
                                               offload_optimizer=True, verify_checkpoint=True,
                                               loss_scaler={"initial_scale": 8.0})
    options = strategy.options  # normalised once, in the options
    assert options.offload == OffloadSettings("cpu") and options.verify_mode == "strict"
    assert options.loss_scaler_settings == {"initial_scale": 8.0} and options.fp8_exclude == ("blocks.0.*",)
    assert options.fp8_recipe is not None and StrategyOptions().fp8_recipe is None
    assert options.requested["tensor_parallel_size"] == 2 and options.requested["data_parallel_size"] == "auto"


def test_replace_checks_and_normalises_again():
    options = StrategyOptions()
    assert replace(options, verify_checkpoint=False).verify_mode == "off"
    with pytest.raises(ValueError, match="async_checkpoint=True needs checkpoint_format='sharded'"):
        replace(options, async_checkpoint=True, checkpoint_format="full")
    resolved = StrategyOptions(tensor_parallel_size="auto").resolved(
        {"tensor_parallel_size": 2, "data_parallel_size": 1}, "1f1b")
    assert resolved.requested["tensor_parallel_size"] == 2 and resolved.requested["data_parallel_size"] == 1
