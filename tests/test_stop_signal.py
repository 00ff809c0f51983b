"""A stop by signal, in one process: what the handlers note and when a second Ctrl-C aborts (the stop itself, over
ranks under Lightning's launcher: test_fault_launch.py; the time limit's requeue: test_slurm.py)."""

import os
import signal

import pytest

from lightning_megatron.strategy import requeue
from lightning_megatron.strategy.requeue import SaveAndRequeue, StopOnSignal, StoppedBySignal, exit_code


def test_the_exit_codes_are_the_shells_for_a_process_ended_by_the_signal():
    assert (exit_code(signal.SIGTERM), exit_code(signal.SIGINT)) == (143, 130)
    stop = StoppedBySignal(signal.SIGTERM, None)
    assert isinstance(stop, SystemExit) and stop.code == 143


def test_a_second_ctrl_c_aborts_at_once_but_torchruns_copy_of_the_first_does_not(monkeypatch, capfd):
    clock = [100.0]
    monkeypatch.setattr(requeue.time, "monotonic", lambda: clock[0])
    stop = StopOnSignal()
    before = {signum: signal.getsignal(signum) for signum in requeue.STOP_SIGNALS}
    try:
        stop._install(stop.stop_signals)
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C: noted, nothing raised here
        clock[0] += 0.05
        os.kill(os.getpid(), signal.SIGINT)  # the same press, passed on by torchrun a moment later
        os.kill(os.getpid(), signal.SIGTERM)
        assert set(stop.received) == {signal.SIGINT, signal.SIGTERM}
        err = capfd.readouterr().err
        assert err.count("Ctrl-C (SIGINT) received") == 1 and "Ctrl-C again to stop now, without saving" in err
        assert "SIGTERM received" in err
        clock[0] += 2
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
        assert "Ctrl-C again: stopping now, without saving." in capfd.readouterr().err
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)


def test_the_time_limit_signal_outranks_a_plain_stop_and_leaves_sigterm_to_the_stop():
    requeue_ = SaveAndRequeue("SIGUSR1")
    assert requeue_.watched == [signal.SIGUSR1, signal.SIGTERM, signal.SIGINT]
    assert SaveAndRequeue("SIGTERM").watched == [signal.SIGTERM, signal.SIGINT]
