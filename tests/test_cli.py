"""The ``lightning-megatron`` command: config parsing and the default run, as a user types them."""

import shutil
import sys
import warnings
from pathlib import Path

import pytest
import yaml

from launch import Started, child_env, run_job, selected
from lightning_megatron.checkpoint import consolidated_state_dict, open_sharded
from lightning_megatron.cli import main

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "gpt-tiny.yaml"


@pytest.mark.parametrize("config", sorted(p.name for p in (REPO / "configs").glob("*.yaml")))
def test_every_config_parses(config, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(REPO / "configs" / config), "--print_config"])
    assert exit_info.value.code == 0
    printed = capsys.readouterr().out
    assert "lightning_megatron.Megatron3DStrategy" in printed and "class_path: lightning_megatron.models." in printed


def planned_configs(paths) -> dict:
    """What the layout planner predicts for each config's own layout (``lightning-megatron plan --as-configured``).
    It builds every rank's shards over torch's fake process group: the test asks for ``no_process_group``."""
    from lightning_megatron.commands.plan import configured_layout, planner_from_config
    from lightning_megatron.plan import GPUS
    from lightning_megatron.plan.layout import check_layout

    numbers = {}
    for path in paths:
        config = yaml.safe_load(Path(path).read_text())
        trainer = config["trainer"]
        gpus = trainer.get("devices", 1) * trainer.get("num_nodes", 1)
        planner = planner_from_config(config, gpus=gpus, hardware=GPUS["a100"])
        layout = configured_layout(config, gpus, planner.workload)
        check_layout(layout, planner.workload, planner.module, planner.shape.num_layers)  # the strategy's checks
        ranks = planner.rank_memory(layout)
        inventory = planner.inventory(layout.tensor_parallel_size, layout.expert_parallel_size)
        held = [inventory.rank_parameters(pipeline_parallel_size=layout.pipeline_parallel_size,
                                          virtual_pipeline_size=layout.virtual_pipeline_size, pipeline_rank=r)
                for r in range(layout.pipeline_parallel_size)]
        numbers[Path(path).stem] = {
            "peak_state": max(sum(rank.model_state_bytes.values()) for rank in ranks),
            "peak_total": max(rank.total for rank in ranks),
            "layers": [len({n.split(".")[2] for p in rank for n in p.entry.names if ".blocks." in n}) for rank in held],
            "peak_parameters": max(sum(p.entry.numel for p in rank) for rank in held)}
    return numbers


@pytest.mark.slow
def test_every_config_layout_validates_and_fits_its_gpus(no_process_group):
    """The planner runs the strategy's layout checks on every config and predicts its memory per GPU: each fits an
    80 GB GPU (A100), the byte-exact model states and the predicted activations together."""
    reports = planned_configs(sorted((REPO / "configs").glob("*.yaml")))
    for name, report in reports.items():
        assert report["peak_total"] < 80 * 10**9, (name, report)
    report = reports["llama-3.1-70b"]
    assert report["layers"] == [20] * 4
    assert report["peak_parameters"] == 2_271_551_488  # 20 layers / 8 + the output layer / 8 + the final norm
    assert report["peak_state"] == 7 * 2_271_551_488  # 4Ψ + 12Ψ/N at N=4


def test_print_config_parses_and_overrides(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(CONFIG), "--trainer.max_steps=7", "--print_config"])
    assert exit_info.value.code == 0
    printed = capsys.readouterr().out
    assert "max_steps: 7" in printed
    assert "lightning_megatron.Megatron3DStrategy" in printed
    assert "tensor_parallel_size: 2" in printed


def test_fp8_and_its_exclusions_parse_from_the_command_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(CONFIG), "--trainer.strategy.init_args.fp8=rowwise",
              "--trainer.strategy.init_args.fp8_exclude=[blocks.0.*, blocks.3.*]", "--print_config"])
    assert exit_info.value.code == 0
    printed = capsys.readouterr().out
    assert "fp8: rowwise" in printed
    assert "- blocks.0.*" in printed and "- blocks.3.*" in printed


def test_a_weighted_blend_parses_from_the_command_line_as_megatron_writes_it(capsys, tmp_path):
    from lightning_megatron.data.blend import parse_data_prefix

    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(CONFIG), "--data.data_prefix=[0.3, data/code, 0.7, data/web]", "--print_config"])
    assert exit_info.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)["data"]["init_args"]
    assert parse_data_prefix(printed["data_prefix"]) == (["data/code", "data/web"], [0.3, 0.7])
    assert printed["split"] == "969,30,1"


DEFAULT_RUN_TEST = "test_default_run_trains_with_tensor_parallelism_and_saves_a_layout_free_checkpoint"


@pytest.fixture(scope="module", autouse=True)
def default_run(request, tmp_path_factory):
    """``lightning-megatron fit --config configs/gpt-tiny.yaml`` (shortened) as a user types it, warnings shown: its own
    process, and Lightning's launcher starts the config's second process. Started at the module's first test when
    this session runs its test: its second process imports while its first waits, a core the other tests use."""
    if not selected(request, DEFAULT_RUN_TEST):
        yield None
        return
    executable = shutil.which("lightning-megatron")
    assert executable, "install the package (pip install -e .) so the lightning-megatron command exists"
    out = tmp_path_factory.mktemp("default_run")
    run = Started([executable, "fit", "--config", str(CONFIG), "--trainer.max_steps=4",
                   "--trainer.val_check_interval=4", "--trainer.limit_val_batches=2", "--data.max_files=40",
                   f"--trainer.default_root_dir={out}"], out,
                  env=child_env(PYTHONWARNINGS="default"))  # child_env hides warnings
    yield run
    run.stop()


def command_on_ranks(tmp_path, *args) -> str:
    """``lightning-megatron ARGS`` for a config of 2 devices, as torchrun runs it: ``cli.main(ARGS)`` on each rank of
    the 2-rank pool (``workers/cli_fit.py``); what the ranks printed."""
    _, proc = run_job("cli_fit", 2, tmp_path, *args)
    return proc.stdout + proc.stderr


@pytest.mark.slow
def test_default_run_trains_with_tensor_parallelism_and_saves_a_layout_free_checkpoint(default_run, no_process_group):
    result, tmp_path = default_run.result(), default_run.cwd
    assert result.returncode == 0, result.stderr[-5000:]
    assert "tp=2 pp=1 dp=1" in result.stdout + result.stderr
    # The console command, warnings shown: no warning that LightningCLI got both `args` and a command line.
    assert ARGS_WARNING not in result.stderr, result.stderr[-3000:]
    # What the strategy reports after the first step is what the planner predicts for the config.
    total = planned_configs([CONFIG])[CONFIG.stem]["peak_state"]
    lines = [line for line in (result.stdout + result.stderr).splitlines() if "model state" in line]
    assert len(lines) == 1 and lines[0].startswith("model state per rank"), lines  # one line, not one per rank
    assert lines[0].endswith(f"(total {total / 2**20:.2f} MiB)"), lines
    checkpoints = list(tmp_path.rglob("*.ckpt"))
    assert len(checkpoints) == 1, checkpoints
    saved = open_sharded(checkpoints[0])  # a directory: each rank wrote its own shards
    assert saved.info["global_step"] == 4
    assert saved.info["layout"]["tensor_parallel_size"] == 2
    assert saved.trainer_state()["global_step"] == 4
    # Full global shapes: the vocabulary is stored unpadded.
    assert consolidated_state_dict(checkpoints[0])["model.embedding.wte.weight"].shape == (257, 64)


@pytest.mark.slow
def test_bert_tiny_config_trains_two_steps(tmp_path):
    command_on_ranks(
        tmp_path, "fit", "--config", str(REPO / "configs" / "bert-tiny.yaml"), "--trainer.max_steps=2",
        "--trainer.val_check_interval=2", "--trainer.limit_val_batches=1", "--data.max_files=30",
        f"--trainer.default_root_dir={tmp_path}",
    )
    checkpoint = open_sharded(next(tmp_path.rglob("*.ckpt"))).trainer_state()
    assert checkpoint["global_step"] == 2
    assert checkpoint["hyper_parameters"]["config"]["norm_position"] == "pre"


ARGS_WARNING = "LightningCLI's args parameter is intended"


def test_main_with_its_own_arguments_hides_that_one_warning_and_no_other(monkeypatch, capsys):
    """``main([...])`` inside a process whose sys.argv holds other arguments (pytest's here): LightningCLI's warning
    about it is not shown, a warning raised next to it still is."""
    from lightning.pytorch.cli import LightningCLI

    parse_arguments = LightningCLI.parse_arguments

    def parse_and_warn(self, parser, args):
        warnings.warn("another warning while parsing", UserWarning)
        parse_arguments(self, parser, args)

    monkeypatch.setattr(LightningCLI, "parse_arguments", parse_and_warn)
    monkeypatch.setattr(sys, "argv", ["lightning-megatron", "fit", "--something-else"])
    with warnings.catch_warnings(record=True) as caught, pytest.raises(SystemExit) as exit_info:
        warnings.simplefilter("always")
        main(["fit", "--config", str(CONFIG), "--print_config"])
    assert exit_info.value.code == 0
    messages = [str(warning.message) for warning in caught]
    assert "another warning while parsing" in messages
    assert not [message for message in messages if ARGS_WARNING in message], messages
    assert "lightning_megatron.Megatron3DStrategy" in capsys.readouterr().out


def test_compile_and_adam_implementation_from_yaml(tmp_path, capsys):
    """The strategy's ``compile`` (a dict of torch.compile arguments) and the recipe's ``adam_implementation``,
    read from a config file as a user writes them."""
    config = yaml.safe_load(CONFIG.read_text())
    config["trainer"]["strategy"]["init_args"]["compile"] = {"backend": "aot_eager"}
    config["model"]["init_args"]["adam_implementation"] = "foreach"
    path = tmp_path / "compiled.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(path), "--print_config"])
    assert exit_info.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["trainer"]["strategy"]["init_args"]["compile"] == {"backend": "aot_eager"}
    assert printed["model"]["init_args"]["adam_implementation"] == "foreach"


@pytest.mark.slow
def test_tiny_sft_config_learns_the_taught_answer_format(tmp_path, capsys):
    """configs/llama-tiny-sft.yaml as the README runs it, shortened: the loss on the responses falls, and the generate
    command, asking held-out prompts in the taught prompt style, gets answers in the taught format every time (the
    format, not the answers: those take far longer at this size)."""
    import csv

    from lightning_megatron.data import SFTDataModule
    from lightning_megatron.data.instructions import ANSWER_PATTERN
    from lightning_megatron.commands.generate import main as generate

    command_on_ranks(tmp_path, "fit", "--config", str(REPO / "configs" / "llama-tiny-sft.yaml"),
                     "--trainer.max_steps=150", "--trainer.val_check_interval=150", "--trainer.limit_val_batches=2",
                     "--trainer.log_every_n_steps=5", "--trainer.logger=lightning.pytorch.loggers.CSVLogger",
                     f"--trainer.logger.init_args.save_dir={tmp_path}", f"--trainer.default_root_dir={tmp_path}")
    rows = list(csv.DictReader(next(tmp_path.rglob("metrics.csv")).open()))
    losses = [float(row["train_loss"]) for row in rows if row.get("train_loss")]
    assert losses[-1] < 0.4 * losses[0], losses  # ~5.5 (uniform over bytes) down to ~1

    prompts = [turns[-1].content for turns, _ in SFTDataModule().held_out("validation")[:12]]
    checkpoint = next(tmp_path.rglob("*.ckpt"))
    capsys.readouterr()
    generate(["--checkpoint", str(checkpoint), "--prompt-style", "plain", "--max-new-tokens", "16",
              *[arg for prompt in prompts for arg in ("--prompt", prompt)]])
    printed = capsys.readouterr().out.split("-" * 40 + "\n")[:-1]
    answers = [block.split("\n", 1)[1].strip() for block in printed]
    assert len(answers) == len(prompts)
    assert all(ANSWER_PATTERN.fullmatch(answer) for answer in answers), list(zip(prompts, answers))


# ------------------------------------------------------------------ what a user reads: help, typos, build errors
def test_help_lists_every_subcommand_and_tool_in_whole_sentences(capsys):
    """Today's help: the tools on one line, cut mid-sentence ("...; write the best"), then Lightning's help with
    fit/validate/test/predict only, two of them cut ("never run on your")."""
    from lightning_megatron.cli import TRAINER_COMMANDS
    from lightning_megatron.commands import TOOLS

    main(["--help"])
    printed = " ".join(capsys.readouterr().out.split())
    descriptions = {**TRAINER_COMMANDS, **{name: text for name, (text, _) in TOOLS.items()}}
    assert set(descriptions) == {"fit", "validate", "test", "predict", "preprocess", "document-ends",
                                 "train-tokenizer", "checkpoint", "generate", "plan", "simulate"}
    for name, text in descriptions.items():
        assert text[0].isupper() and text.endswith("."), (name, text)
        assert f"{name} {text}" in printed, name


def write_config(tmp_path, edit) -> Path:
    """gpt-tiny.yaml with ``edit(config)`` applied, as a user's own config file."""
    config = yaml.safe_load(CONFIG.read_text())
    edit(config)
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def rename(section: dict, old: str, new: str) -> None:
    section[new] = section.pop(old)


@pytest.mark.parametrize("where, edit, extra, hint", [
    ("yaml", lambda c: rename(c["model"]["init_args"], "learning_rate", "learnng_rate"), [], "'learning_rate'"),
    ("yaml", lambda c: rename(c["data"]["init_args"], "seq_length", "seq_lenght"), [], "'seq_length'"),
    ("yaml", lambda c: rename(c["trainer"], "max_steps", "max_step"), [], "'trainer.max_steps'"),
    ("yaml", lambda c: rename(c["trainer"]["strategy"]["init_args"], "tensor_parallel_size", "tensor_paralel_size"),
     [], "'tensor_parallel_size'"),
    ("command line", None, ["--model.init_args.learnng_rate", "0.1"], "'learning_rate'"),
    ("command line", None, ["--trainer.max_stepz", "5"], "'trainer.max_steps'"),
], ids=["model-yaml", "data-yaml", "trainer-yaml", "strategy-yaml", "model-argument", "trainer-argument"])
def test_a_misspelled_key_gets_did_you_mean(tmp_path, capsys, where, edit, extra, hint):
    config = write_config(tmp_path, edit) if edit else CONFIG
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(config), *extra])
    assert exit_info.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"did you mean {hint}?" in last, last


def test_an_error_while_building_the_model_is_its_message_alone(capsys, monkeypatch):
    """Today: ~80 lines, two tracebacks and jsonargparse's ``Namespace(...)`` dump as the last line."""
    from lightning_megatron.cli_errors import TRACEBACK_VARIABLE

    monkeypatch.delenv(TRACEBACK_VARIABLE, raising=False)
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(CONFIG), "--model.init_args.config", "gpt-tinyy"])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith("error: Unknown GPT preset 'gpt-tinyy'. Available presets:")
    assert "Traceback" not in err and "Namespace(" not in err and len(err.strip().splitlines()) <= 3, err
    assert f"{TRACEBACK_VARIABLE}=1" in err
    monkeypatch.setenv(TRACEBACK_VARIABLE, "1")  # the way to the whole traceback the message names
    with pytest.raises(ValueError) as raised:
        main(["fit", "--config", str(CONFIG), "--model.init_args.config", "gpt-tinyy"])
    assert "gpt-tinyy" in str(raised.value.__cause__)


def test_an_error_not_raised_by_the_project_keeps_one_traceback():
    """Another library's error while building is raised as itself, without jsonargparse's wrapper around it."""
    from lightning_megatron.cli_errors import report_build_error

    def users_module():
        raise TypeError("a bug in the user's own module")

    try:
        try:
            users_module()
        except TypeError as error:
            raise ValueError("Does not validate against any of the Union subtypes") from error
    except ValueError as wrapper:
        with pytest.raises(TypeError, match="user's own module") as raised:
            report_build_error(wrapper)
    assert raised.value.__suppress_context__ and raised.value.__cause__ is None


@pytest.mark.parametrize("config", sorted(p.name for p in (REPO / "configs").glob("*.yaml")))
def test_every_config_validates_within_a_short_run(config):
    """``--trainer.max_steps 5`` with every shipped config: a val_check_interval longer than the run's batches
    becomes its last batch (Lightning refuses the longer one: "val_check_interval (100) must be less than or equal
    to the number of the training batches (5)"); a shorter one stays."""
    from lightning_megatron.cli import clamp_val_check_interval

    trainer = yaml.safe_load((REPO / "configs" / config).read_text())["trainer"]
    interval, accumulate = trainer.get("val_check_interval"), trainer.get("accumulate_grad_batches", 1)
    for max_steps in (5, 10**9):
        short = {**trainer, "max_steps": max_steps}
        clamp_val_check_interval(short)
        if isinstance(interval, int):
            assert short["val_check_interval"] == min(interval, max_steps * accumulate)
        else:
            assert short["val_check_interval"] == interval


@pytest.mark.slow
def test_the_default_config_with_fewer_steps_than_its_val_check_interval(tmp_path):
    """The README's ``fit --config configs/gpt-tiny.yaml`` with ``--trainer.max_steps 3`` (its val_check_interval is
    100): it trains, validates after the last step, and its progress bar reads "Epoch 0", not "Epoch 0/-2"."""
    output = command_on_ranks(tmp_path, "fit", "--config", str(CONFIG), "--trainer.max_steps", "3",
                              "--data.max_files=40", f"--trainer.default_root_dir={tmp_path}")
    assert "val_check_interval=100 batches is more than this run's 3" in output
    assert "Epoch 0" in output and "Epoch 0/-2" not in output
    assert "val_loss:" in output  # the progress bar's metrics, after the validation at step 3
    assert open_sharded(next(tmp_path.rglob("*.ckpt"))).trainer_state()["global_step"] == 3
