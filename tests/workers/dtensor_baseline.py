"""The throughput benchmark's DTensor baseline (``python -m benchmarks.throughput --worker model_parallel_tp2``, what
its parent launches under torchrun) on 2 ranks, once per command line given, one after another in the same ranks.

argv: OUT_DIR COMMAND_LINES, a JSON list of the benchmark's flags (model and sizes), one list per run. Run ``i``
writes what the benchmark's worker writes (``rank{r}.json``: step seconds, peak bytes, last loss) into
``OUT_DIR/run{i}``.
"""

import json
from pathlib import Path

from benchmarks import throughput
from entry import run_script


def main(out_dir: Path, args: list[str]) -> None:
    for number, flags in enumerate(json.loads(args[0])):
        result_dir = out_dir / f"run{number}"
        result_dir.mkdir(exist_ok=True)
        throughput.worker_main(throughput.parse_args(
            [*flags, "--worker", "model_parallel_tp2", f"--result-dir={result_dir}"]))


if __name__ == "__main__":
    run_script(main, join=False)
