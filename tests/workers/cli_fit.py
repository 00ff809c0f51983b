"""``lightning-megatron ARGS`` on every rank, as torchrun runs the command: ``lightning_megatron.cli.main(ARGS)``.

argv: OUT_DIR ARGS... (the command's own arguments; the working directory is OUT_DIR). Lightning under torchrun
starts no processes of its own (a config's ``devices: 2`` are the job's 2 ranks), so a config's run needs no
console process; what the command prints is each rank's output (``job.rank{r}.log`` in a pool, the launch's
stdout and stderr as a script). Rank r writes rank{r}.json (``{}``) when the command has returned.
"""

import json
import os
from pathlib import Path

from entry import run_script
from lightning_megatron.cli import main as command


def main(out_dir: Path, args: list[str]) -> None:
    command(args)
    (out_dir / f"rank{os.environ['RANK']}.json").write_text(json.dumps({}))


if __name__ == "__main__":
    run_script(main, join=False)
