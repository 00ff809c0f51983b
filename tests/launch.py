"""Run a worker on gloo ranks and collect what each rank wrote.

Workers receive an output directory as their first argument; rank ``r`` writes
``rank{r}.json`` (small results) and optionally ``.pt`` files (tensors, loaded with
``weights_only=True``).

``run_job`` runs a worker function (``main(out_dir, args)``, see ``workers/entry.py``) as a job on a rank pool:
one torchrun of 1, 2, 4 or 8 ranks per session, started on first use, since starting processes and importing
Lightning costs several seconds a launch. ``launch`` starts a torchrun of its own, for tests whose subject is the
process itself (a stall, a kill, a signal, a crash, thread counts). ``Started`` starts a command that a test reads
later: a module fixture starts several at its first test (``selected``: those of the tests the session runs), so
that processes which leave a core idle (Lightning's launcher imports rank 1 only once rank 0 has) run side by side.
Every start and job is timed (``LAUNCHES``; the session's summary prints them).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from dataclasses import dataclass
from typing import Optional

REPO_ROOT = Path(__file__).resolve().parents[1]
WORKERS = Path(__file__).resolve().parent / "workers"
POOL_RANK = Path(__file__).resolve().parent / "pool_rank.py"


@dataclass
class Launch:
    """One timed start or job: ``kind`` "torchrun" (a fresh launch), "nodes", "slurm", "pool start" or "job"."""

    kind: str
    worker: str
    ranks: int
    seconds: float


LAUNCHES: list[Launch] = []


def _timed(kind: str, worker: str, ranks: int, started: float) -> None:
    LAUNCHES.append(Launch(kind, worker, ranks, time.monotonic() - started))


# Set by an in-process Trainer earlier in the session; a child must not inherit them (it would try to
# join, or bind the port of, this process's process group, or seed as that run was seeded).
_DISTRIBUTED_ENV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK",
                    "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "PL_GLOBAL_SEED", "PL_SEED_WORKERS")


def child_env(**extra: str) -> dict[str, str]:
    """The environment for a subprocess that starts its own distributed job."""
    env = {k: v for k, v in os.environ.items() if k not in _DISTRIBUTED_ENV}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT), "PYTHONWARNINGS": "ignore",
            "PYTHONFAULTHANDLER": "1", **extra}


def torchrun_command(worker: str, nproc: int, out_dir: Path, *args: str) -> list[str]:
    """The command that runs ``tests/workers/<worker>`` on ``nproc`` local ranks (a ``Started`` one runs it later)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            str(WORKERS / worker), str(out_dir), *args]


def launch(worker: str, nproc: int, out_dir: Path, *args: str, timeout: float = 600, expect_failure: bool = False):
    """Run ``tests/workers/<worker>`` on ``nproc`` ranks; return (per-rank JSON results, completed process)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    env = child_env()
    cmd = torchrun_command(worker, nproc, out_dir, *args)
    started = time.monotonic()
    try:
        proc = subprocess.run(cmd, env=env, cwd=out_dir, capture_output=True, text=True, timeout=timeout)
    finally:
        _timed("torchrun", worker, nproc, started)
    if expect_failure:
        return [], proc
    if proc.returncode != 0:
        raise AssertionError(f"{worker} failed with exit code {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    results = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(nproc)
               if (out_dir / f"rank{r}.json").exists()]
    return results, proc


class Started:
    """A command started now and read later, for tests that start several processes at once: a process that spends
    most of its time importing, or waiting while its second rank imports, leaves a core idle. Its output goes to
    files next to ``cwd`` (a pipe could fill up while another process is read); ``result()`` waits for it."""

    def __init__(self, cmd: list[str], cwd: Path, timeout: float = 600, env: Optional[dict[str, str]] = None,
                 **popen) -> None:
        cwd.mkdir(parents=True, exist_ok=True)
        self.cmd, self.cwd, self.timeout, self.started = cmd, cwd, timeout, time.monotonic()
        self.logs = [open(cwd.with_name(f"{cwd.name}.{stream}"), "w+") for stream in ("stdout", "stderr")]
        self.process = subprocess.Popen(cmd, cwd=cwd, env=child_env() if env is None else env, text=True,
                                        stdout=self.logs[0], stderr=self.logs[1], **popen)
        self.completed: Optional[subprocess.CompletedProcess] = None

    def result(self) -> subprocess.CompletedProcess:
        """The completed process (``subprocess.run``'s, output as text); AssertionError if it ran past its timeout."""
        if self.completed is None:
            try:
                self.process.wait(timeout=max(self.started + self.timeout - time.monotonic(), 0))
            except subprocess.TimeoutExpired:
                self.stop()
                raise AssertionError(f"{self.cmd} did not finish in {self.timeout} s") from None
            stdout, stderr = [(log.seek(0), log.read())[1] for log in self.logs]
            self.completed = subprocess.CompletedProcess(self.cmd, self.process.returncode, stdout, stderr)
            self.stop()
        return self.completed

    def stop(self) -> None:
        """End the process if it still runs (a test that failed before reading it), and time it."""
        if self.logs[0].closed:
            return
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        for log in self.logs:
            log.close()
        scripts = [arg for arg in self.cmd[1:] if arg.endswith((".py", ".sh"))]  # a torchrun's: after its flags
        _timed("started", Path((scripts or self.cmd[1:] or self.cmd)[0]).name, 1, self.started)


def selected(request, test: str, **params) -> bool:
    """Whether this session runs ``test`` (a test function of the module that asks, with these parameters if given):
    a module fixture that starts a test's process early starts it only then."""
    return any(item.module is request.module and item.originalname == test
               and all(item.callspec.params[name] == value for name, value in params.items())
               for item in request.session.items)


def free_slurm_port() -> tuple[str, int]:
    """A SLURM job id whose derived port (Lightning's ``SLURMEnvironment``: 15000 + the id's last four digits)
    is free on this machine, and that port."""
    import random
    import socket

    for port in random.Random(os.getpid()).sample(range(15000, 25000), 200):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        return f"31{port - 15000:04d}", port
    raise RuntimeError("no free port in 15000-24999 for a SLURM job id")


def launch_slurm(worker: str, nodes: int, tasks_per_node: int, out_dir: Path, *args: str, timeout: float = 600,
                 job_id: str = "310042", **extra: str):
    """Run ``tests/workers/<worker>`` as the tasks of a SLURM job of ``nodes`` x ``tasks_per_node`` would run,
    all on this machine: each process gets the variables ``srun`` sets for its task (no SLURM needed; inherited
    SLURM_* variables are dropped). ``extra``: more variables for every task (``MASTER_PORT`` as an operator sets
    it). Returns (per-rank JSON results, the completed processes)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    base = {k: v for k, v in child_env(**extra).items() if not k.startswith("SLURM_")}
    tasks = nodes * tasks_per_node
    # Lightning takes MASTER_ADDR from the first host of SLURM_NODELIST, as a cluster's "node[01-02]" gives node01.
    job = {"SLURM_JOB_ID": job_id, "SLURM_JOB_NAME": "lightning-megatron", "SLURM_NTASKS": str(tasks),
           "SLURM_NTASKS_PER_NODE": str(tasks_per_node), "SLURM_NNODES": str(nodes),
           "SLURM_JOB_NUM_NODES": str(nodes), "SLURM_NODELIST": f"127.0.0.[1-{nodes}]",
           "SLURM_JOB_NODELIST": f"127.0.0.[1-{nodes}]"}
    processes, logs = [], []
    started = time.monotonic()
    for task in range(tasks):
        env = {**base, **job, "SLURM_PROCID": str(task), "SLURM_LOCALID": str(task % tasks_per_node),
               "SLURM_NODEID": str(task // tasks_per_node)}
        cmd = [sys.executable, str(WORKERS / worker), str(out_dir), *args]
        logs.append(open(out_dir / f"task{task}.log", "w+"))  # a pipe could fill up while another task is read
        processes.append(subprocess.Popen(cmd, env=env, cwd=out_dir, stdout=logs[-1], stderr=subprocess.STDOUT,
                                          text=True))
    outputs = []
    try:
        deadline = time.monotonic() + timeout
        for process, log in zip(processes, logs):
            try:
                process.wait(timeout=max(deadline - time.monotonic(), 0))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"{worker} hung for {timeout} s; where each task stood:\n"
                                     + _stacks_of_the_hung(processes, logs)) from None
            log.seek(0)
            outputs.append(log.read())
    finally:
        for process, log in zip(processes, logs):
            if process.poll() is None:
                process.kill()
                process.wait()
            log.close()
        _timed("slurm", worker, tasks, started)
    failed = [(task, p.returncode, out) for task, (p, out) in enumerate(zip(processes, outputs)) if p.returncode]
    if failed:
        raise AssertionError(f"{worker} failed: " + "\n".join(f"task {t} exit {rc}:\n{out[-4000:]}" for t, rc, out in failed))
    results = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(tasks)]
    return results, processes


def _stacks_of_the_hung(processes, logs) -> str:
    """SIGABRT to every task still running: Python's fault handler (``PYTHONFAULTHANDLER``, set by ``child_env``)
    writes each thread's stack into the task's log before the process ends; return every task's log tail."""
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGABRT)
    for process in processes:
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
    tails = []
    for task, log in enumerate(logs):
        log.flush()
        log.seek(0)
        tails.append(f"--- task {task} (exit {processes[task].returncode}):\n{log.read()[-6000:]}")
    return "\n".join(tails)


def free_port() -> int:
    """A TCP port nothing listens on now (the OS picks it), for a rendezvous on localhost."""
    import socket

    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        return probe.getsockname()[1]


def launch_nodes(worker: str, nodes: int, nproc: int, out_dir: Path, *args: str, rendezvous: str = "c10d",
                 cwds: Optional[list[Path]] = None, timeout: float = 600, expect_failure: bool = False):
    """``launch`` over ``nodes`` "nodes" on this machine: one torchrun per node, started together, joining one
    rendezvous on localhost (``c10d``: a rendezvous store, node ranks by arrival; ``static``: ``--node-rank i``
    with ``--master-addr/--master-port``). Node ``i``'s processes see ``MULTINODE_LAUNCH=i`` and run in
    ``cwds[i]`` (default ``out_dir``). Returns (per-rank JSON results in global rank order, completed processes)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    if rendezvous == "c10d":
        meeting = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", "multinode"]
    elif rendezvous == "static":
        meeting = ["--master-addr", "localhost", "--master-port", str(port)]
    else:
        raise ValueError(f"rendezvous must be 'c10d' or 'static', got {rendezvous!r}")
    procs = []
    started = time.monotonic()
    for node in range(nodes):
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}", f"--nproc-per-node={nproc}",
               f"--node-rank={node}", *meeting, str(WORKERS / worker), str(out_dir), *args]
        cwd = cwds[node] if cwds else out_dir
        Path(cwd).mkdir(parents=True, exist_ok=True)
        logs = [open(out_dir / f"node{node}.{stream}", "w+") for stream in ("out", "err")]  # pipes could fill up
        procs.append((subprocess.Popen(cmd, env=child_env(MULTINODE_LAUNCH=str(node)), cwd=cwd, text=True,
                                       stdout=logs[0], stderr=logs[1]), logs))
    finished = []
    try:
        for proc, logs in procs:
            proc.wait(timeout=timeout)
            stdout, stderr = [(log.seek(0), log.read())[1] for log in logs]
            finished.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    finally:
        for proc, logs in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            for log in logs:
                log.close()
        _timed("nodes", worker, nodes * nproc, started)
    if not expect_failure:
        for node, proc in enumerate(finished):
            if proc.returncode != 0:
                raise AssertionError(f"{worker}, node {node}, failed with exit code {proc.returncode}:\n"
                                     f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    results = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(nodes * nproc)
               if (out_dir / f"rank{r}.json").exists()]
    return results, finished


# ------------------------------------------------------------------ rank pools
POOL_SIZES = (1, 2, 4, 8)  # 1: the single-process references the layouts are compared with
POOL_START_SECONDS = 300.0
POOL_SYNC_SECONDS = 60.0


class RankPool:
    """One torchrun of ``nproc`` ranks (``pool_rank.py``) that runs worker functions as jobs, one at a time.

    A job that raises on every rank leaves the pool as it was (each rank caught its error and the ranks met at a
    barrier afterwards); one that hangs, kills a rank, fails on some ranks only, or leaves the ranks at different
    collectives ends the pool, and the next job starts a new one. The failing test gets every rank's output."""

    def __init__(self, nproc: int, root: Path) -> None:
        self.nproc, self.root = nproc, root
        self.starts, self.process, self.pids, self.jobs = 0, None, [], 0

    @property
    def dir(self) -> Path:
        return self.root / f"pool{self.nproc}-start{self.starts}"

    def _start(self) -> None:
        self.starts += 1
        self.dir.mkdir(parents=True)
        self.jobs, started = 0, time.monotonic()
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={self.nproc}",
               str(POOL_RANK), str(self.dir), str(os.getpid())]
        self.log = open(self.dir / "torchrun.log", "w+")
        self.process = subprocess.Popen(cmd, env=child_env(), cwd=self.dir, stdout=self.log, stderr=subprocess.STDOUT)
        ready = [self.dir / f"ready{r}.pid" for r in range(self.nproc)]
        while not all(path.exists() for path in ready):
            if self.process.poll() is not None or time.monotonic() - started > POOL_START_SECONDS:
                self.close()
                raise AssertionError(f"the {self.nproc}-rank pool did not start:\n{self._read(self.dir / 'torchrun.log')}")
            time.sleep(0.05)
        self.pids = [int(path.read_text()) for path in ready]
        _timed("pool start", "pool_rank.py", self.nproc, started)

    def run(self, worker: str, out_dir: Path, args: tuple[str, ...], timeout: float, expect_failure: bool):
        if self.process is None:
            self._start()
        number, started = self.jobs, time.monotonic()
        self.jobs += 1
        job = self.dir / f"job{number}.json"
        job.with_name(job.name + ".tmp").write_text(json.dumps({"worker": worker, "out_dir": str(out_dir),
                                                                "args": list(args)}))
        job.with_name(job.name + ".tmp").rename(job)
        reports = [self.dir / f"job{number}.rank{r}.json" for r in range(self.nproc)]
        finished = self._wait(reports, started + timeout)
        if not finished:  # hung or a rank died: every rank's Python stacks, then a new pool for the next job
            self._abort()
        errors = [json.loads(path.read_text())["error"] if path.exists() else "no report" for path in reports]
        if finished and (all(errors) or not any(errors)):
            if not self._wait([self.dir / f"job{number}.rank{r}.synced" for r in range(self.nproc)],
                              time.monotonic() + POOL_SYNC_SECONDS):
                self._abort()  # the ranks stand at different collectives: the next job would hang
        elif finished:
            self._abort()  # some ranks failed, the others may wait for them
        _timed("job", worker, self.nproc, started)
        outputs = [self._read(out_dir / f"job.rank{r}.log", whole=True) for r in range(self.nproc)]
        torchrun = "" if finished else f"--- torchrun:\n{self._read(self.log.name)}"

        def joined(texts):
            return "".join(f"--- rank {r}:\n{text}" for r, text in enumerate(texts)) + torchrun

        proc = subprocess.CompletedProcess(worker, 0 if finished and not any(errors) else 1, joined(outputs), "")
        if expect_failure:
            return [], proc
        if proc.returncode != 0:
            why = "failed" if finished else f"did not finish in {timeout} s"
            tails = joined(output[-6000:] for output in outputs)  # every rank's last words
            raise AssertionError(f"{worker} {why} on the {self.nproc}-rank pool:\n{tails[-12000:]}")
        return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(self.nproc)
                if (out_dir / f"rank{r}.json").exists()], proc

    def _wait(self, paths: list[Path], deadline: float) -> bool:
        while not all(path.exists() for path in paths):
            if self.process.poll() is not None or time.monotonic() > deadline:
                return all(path.exists() for path in paths)
            time.sleep(0.02)
        return True

    def _abort(self) -> None:
        """SIGABRT to every rank (Python's fault handler writes its stacks into the job's log), then the pool ends."""
        for pid in self.pids:
            _signal(pid, signal.SIGABRT)
        deadline = time.monotonic() + 2  # the stacks are written by then (a rank that ended sooner wrote them)
        while any(_running(pid) for pid in self.pids) and time.monotonic() < deadline:
            time.sleep(0.02)
        self.close()

    def close(self) -> None:
        if self.process is None:
            return
        (self.dir / "stop").touch()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            for pid in self.pids:
                _signal(pid, signal.SIGKILL)
            self.process.kill()
            self.process.wait()
        self.log.close()
        self.process, self.pids = None, []

    @staticmethod
    def _read(path, whole: bool = False) -> str:
        """The file's text, its last 6000 characters unless ``whole`` (a job's output: a test reads it whole, as
        it reads a launch's stdout)."""
        try:
            text = Path(path).read_text(errors="replace")
            return text if whole else text[-6000:]
        except FileNotFoundError:
            return "(no output)\n"


def _running(pid: int) -> bool:
    """Whether process ``pid`` has not ended yet (a zombie, not yet reaped by torchrun, has)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


_POOLS: dict[int, RankPool] = {}


def run_job(worker: str, nproc: int, out_dir: Path, *args: str, timeout: float = 600, expect_failure: bool = False):
    """Run ``tests/workers/<worker>.py``'s ``main(out_dir, args)`` on the session's ``nproc``-rank pool; returns
    what ``launch`` returns: (per-rank JSON results, a completed process whose stdout holds every rank's output).
    ``LM_TEST_POOLS=0`` runs it as a fresh launch instead (to compare the two)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if nproc not in POOL_SIZES or os.environ.get("LM_TEST_POOLS") == "0":
        return launch(f"{worker}.py", nproc, out_dir, *args, timeout=timeout, expect_failure=expect_failure)
    if nproc not in _POOLS:
        import tempfile

        _POOLS[nproc] = RankPool(nproc, Path(tempfile.mkdtemp(prefix="lm-rank-pools-")))
    return _POOLS[nproc].run(worker, out_dir, args, timeout, expect_failure)


def close_pools() -> None:
    """End every pool (at the end of the session)."""
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()
