"""The sbatch scripts of ``examples/slurm``, run by bash as sbatch would run them, with stand-ins for ``srun`` and
``scontrol`` that record their arguments (no SLURM needed). The command lines they build must parse: torchrun's
flags by torchrun's own parser, ``fit``'s by the ``lightning-megatron`` CLI (``--print_config``), so the scripts
stay in step with both. Also how Lightning picks its cluster environment from the variables, and the task-count
check under SLURM."""

import os
import subprocess
from pathlib import Path

import lightning as L
import pytest
import yaml
from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment
from lightning.pytorch.plugins.environments import LightningEnvironment
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch.distributed.run import get_args_parser

from launch import child_env
from lightning_megatron import Megatron3DStrategy
from lightning_megatron.cli import main
from lightning_megatron.strategy.diagnostics import check_process_count

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "examples" / "slurm"
JOB_ID = "4242"

FAKE_SRUN = """#!/bin/bash
for arg in "$@"; do printf '%s\\0' "$arg"; done > "$FAKE_LOG/srun.args"
env > "$FAKE_LOG/srun.env"
"""
FAKE_SCONTROL = """#!/bin/bash
[[ "$1 $2" == "show hostnames" ]] || exit 2
for ((i = 1; i <= SLURM_NNODES; i++)); do printf 'node%02d\\n' "$i"; done
"""


def sbatch_directives(script: Path) -> dict[str, str]:
    lines = [line[len("#SBATCH "):].strip() for line in script.read_text().splitlines() if line.startswith("#SBATCH ")]
    return dict(line.split("=", 1) if "=" in line else (line, "") for line in lines)


def run_batch_script(script: Path, tmp_path: Path, *args: str, gpus_on_node: int = 8, nodes: int = 2):
    """Run ``script`` as the batch step of a ``nodes``-node job would; returns (srun's argv, srun's environment,
    the completed process)."""
    directives = sbatch_directives(script)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {k: v for k, v in child_env().items() if not k.startswith("SLURM_")}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", FAKE_LOG=str(tmp_path), SLURM_JOB_ID=JOB_ID,
               SLURM_JOB_NAME=directives["--job-name"], SLURM_NNODES=str(nodes), SLURM_JOB_NUM_NODES=str(nodes),
               SLURM_JOB_NODELIST=f"node[01-{nodes:02d}]", SLURM_NODELIST=f"node[01-{nodes:02d}]",
               SLURM_NTASKS_PER_NODE=directives["--ntasks-per-node"],
               SLURM_NTASKS=str(nodes * int(directives["--ntasks-per-node"])),
               SLURM_CPUS_PER_TASK=directives["--cpus-per-task"], SLURM_GPUS_ON_NODE=str(gpus_on_node))
    proc = subprocess.run(["bash", str(script), *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    if not (tmp_path / "srun.args").exists():
        return None, None, proc
    argv = (tmp_path / "srun.args").read_text().split("\0")[:-1]
    srun_env = dict(line.split("=", 1) for line in (tmp_path / "srun.env").read_text().splitlines() if "=" in line)
    return argv, srun_env, proc


def parsed_fit(args: list[str], capsys) -> dict:
    """What ``lightning-megatron`` makes of ``args`` (``fit ...``): the full config, as ``--print_config`` prints it."""
    assert args[0] == "fit", args
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--print_config"])
    assert exit_info.value.code == 0
    return yaml.safe_load(capsys.readouterr().out)


@pytest.mark.parametrize("script", ["train.sbatch", "torchrun.sbatch"])
def test_scripts_are_valid_bash(script):
    subprocess.run(["bash", "-n", str(SCRIPTS / script)], check=True)


def test_train_sbatch_runs_one_task_per_gpu_under_slurm_environment(tmp_path, capsys):
    directives = sbatch_directives(SCRIPTS / "train.sbatch")
    assert directives["--ntasks-per-node"] == directives["--gpus-per-node"] == "8", "one task per GPU"
    assert directives["--signal"] == "USR1@90" and "--requeue" in directives
    argv, env, proc = run_batch_script(SCRIPTS / "train.sbatch", tmp_path, "--trainer.max_steps=7")
    assert proc.returncode == 0, proc.stderr
    command = argv.index("python")
    assert "--kill-on-bad-exit=1" in argv[:command], "a task that dies must end the job, not leave the rest waiting"
    assert argv[command:command + 3] == ["python", "-m", "lightning_megatron.cli"]
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("node01", str(15000 + int(JOB_ID[-4:])))  # Lightning's rule
    config = parsed_fit(argv[command + 3:], capsys)
    trainer = config["trainer"]
    # devices parses as the string "8" from a command line (Trainer(devices=...) takes str first), which Lightning
    # reads as 8 devices, as it does the int.
    assert (trainer["num_nodes"], int(trainer["devices"])) == (2, 8), "num_nodes x devices must be SLURM's tasks"
    assert trainer["max_steps"] == 7, "the script's own arguments reach fit"
    assert trainer["default_root_dir"] == "runs/lightning-megatron"
    callbacks = [c["class_path"] for c in trainer["callbacks"]]
    assert "lightning_megatron.callbacks.SaveAndRequeue" in callbacks
    assert "lightning.pytorch.callbacks.ModelCheckpoint" in callbacks, "SaveAndRequeue saves into its folder"
    assert config["ckpt_path"] == "last"
    assert trainer["strategy"]["init_args"]["tensor_parallel_size"] <= 8, "tp within a node"


def test_train_sbatch_refuses_tasks_per_node_that_are_not_the_gpus(tmp_path):
    argv, _, proc = run_batch_script(SCRIPTS / "train.sbatch", tmp_path, gpus_on_node=4)
    assert argv is None and proc.returncode == 1, "srun must not start"
    assert "8 tasks per node but 4 GPUs per node" in proc.stderr and "--ntasks-per-node=4" in proc.stderr


def test_torchrun_sbatch_runs_one_torchrun_per_node(tmp_path, capsys):
    directives = sbatch_directives(SCRIPTS / "torchrun.sbatch")
    assert directives["--ntasks-per-node"] == "1" and directives["--gpus-per-node"] == "8"
    argv, _, proc = run_batch_script(SCRIPTS / "torchrun.sbatch", tmp_path)
    assert proc.returncode == 0, proc.stderr
    command = argv.index("torchrun")
    torchrun = get_args_parser().parse_args(argv[command + 1:])  # torchrun's own parser: every flag must exist
    assert (torchrun.nnodes, torchrun.nproc_per_node) == ("2", "8")
    assert (torchrun.rdzv_backend, torchrun.rdzv_endpoint, torchrun.rdzv_id) == ("c10d", "node01:29500", JOB_ID)
    assert "SIGUSR1" in torchrun.signals_to_handle.split(","), "the time-limit signal must reach the workers"
    lead = int(directives["--signal"].split("@")[1])
    assert directives["--signal"].startswith("USR1@") and torchrun.shutdown_timeout < lead
    assert torchrun.module and torchrun.training_script == "lightning_megatron.cli"
    config = parsed_fit(torchrun.training_script_args, capsys)
    assert (config["trainer"]["num_nodes"], int(config["trainer"]["devices"])) == (2, 8)
    assert "lightning_megatron.callbacks.SaveAndRequeue" in [c["class_path"] for c in config["trainer"]["callbacks"]]


SLURM_TASK = {"SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "2", "SLURM_NNODES": "2", "SLURM_PROCID": "3",
              "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_JOB_ID": JOB_ID, "SLURM_JOB_NAME": "train"}
TORCHRUN_WORKER = {"TORCHELASTIC_RUN_ID": JOB_ID, "RANK": "3", "LOCAL_RANK": "1", "GROUP_RANK": "1",
                   "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "node01", "MASTER_PORT": "29500"}


@pytest.mark.parametrize("variables, environment, ranks", [
    (SLURM_TASK, SLURMEnvironment, (3, 1, 1)),
    ({**SLURM_TASK, **TORCHRUN_WORKER}, TorchElasticEnvironment, (3, 1, 1)),  # torchrun inside an sbatch job
    ({**SLURM_TASK, "SLURM_JOB_NAME": "interactive"}, LightningEnvironment, (0, 0, 0)),  # salloc, then by hand
])
def test_lightning_picks_the_environment_that_started_the_process(monkeypatch, variables, environment, ranks):
    for name in [*os.environ]:
        if name.startswith("SLURM_") or name in TORCHRUN_WORKER:
            monkeypatch.delenv(name)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(rank_zero_only, "rank", rank_zero_only.rank)  # the Trainer sets it to this process's rank
    trainer = L.Trainer(accelerator="cpu", devices=2, num_nodes=2, strategy=Megatron3DStrategy(tensor_parallel_size=2),
                        logger=False)
    assert type(trainer.strategy.cluster_environment) is environment
    assert (trainer.global_rank, trainer.local_rank, trainer.node_rank) == ranks
    assert rank_zero_only.rank == ranks[0]


def test_slurm_tasks_that_are_not_nodes_times_devices_are_refused(monkeypatch):
    """``--ntasks=6 --ntasks-per-node=4`` on 2 nodes: per node the counts agree (Lightning's check passes), but 6
    tasks are not 2 x 4 processes."""
    for name, value in {**SLURM_TASK, "SLURM_NTASKS": "6", "SLURM_NTASKS_PER_NODE": "4"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("WORLD_SIZE", "6")  # what a first fit in this process would have left behind
    with pytest.raises(ValueError) as error:
        check_process_count(SLURMEnvironment(), devices=4, num_nodes=2)
    message = str(error.value)
    assert message.startswith("Megatron3DStrategy: SLURM started 6 tasks (SLURM_NTASKS=6, SLURM_NNODES=2, "
                              "SLURM_NTASKS_PER_NODE=4), but the Trainer was given devices=4 and num_nodes=2"), message
    assert "`#SBATCH --nodes=2 --ntasks-per-node=4` (and no --ntasks)" in message
    monkeypatch.setenv("SLURM_NTASKS", "8")
    monkeypatch.setenv("WORLD_SIZE", "8")
    check_process_count(SLURMEnvironment(), devices=4, num_nodes=2)  # a job that matches passes


def test_save_and_requeue_without_a_model_checkpoint_is_refused(tmp_path):
    from lightning.pytorch.demos.boring_classes import BoringModel

    from lightning_megatron.callbacks import SaveAndRequeue

    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, callbacks=[SaveAndRequeue()], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, default_root_dir=tmp_path)
    with pytest.raises(ValueError, match="SaveAndRequeue saves last.ckpt in a ModelCheckpoint's folder"):
        trainer.fit(BoringModel())
    assert not list(tmp_path.iterdir()), "nothing trained, nothing written"
