"""A rank that hangs never hangs the job silently (docs/watchdog.md). Two gloo ranks; rank 1 stops (SIGSTOP)
or gets stuck at one precise point: inside a task, in the ranks' per-batch agreement, in its data loader, or
where rank 0's caller thread waits in a collective. Rank 0 reports (its rank, the step, what each thread was
doing, the collective it waits in or the loader), and both processes end, non-zero, within the step timeout
plus a margin."""

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from ranks import launch_env

from lightning_hstu.engine import WATCHDOG_EXIT_CODE

SCRIPT = Path(__file__).parent / "scripts" / "hang_two_ranks.py"
STEP_TIMEOUT = 5
MARGIN = 20
"""Seconds past the timeout within which both processes have ended: the report, Lightning's teardown, the
wait for the launched rank to end by itself (3 s), on a loaded two-core machine."""

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads process states from /proc")


@dataclass
class HungRun:
    returncode: int
    """Rank 0's: Lightning's launcher runs rank 0, which launches rank 1."""
    hang_to_end: float
    """Seconds from rank 1's hang to the end of both processes."""
    logs: list[str]
    """What each rank printed."""


def run_with_rank_1_hung(scenario: str, out_dir: Path, accelerator: str = "cpu") -> HungRun:
    out_dir.mkdir()
    pids = [out_dir / f"rank{rank}.pid" for rank in (0, 1)]
    with open(out_dir / "launch.log", "w") as launch_log:
        rank0 = subprocess.Popen(
            [sys.executable, str(SCRIPT), scenario, str(out_dir), str(STEP_TIMEOUT), accelerator],
            stdout=launch_log,
            stderr=subprocess.STDOUT,
            cwd=out_dir,
            env=launch_env(),
        )
    try:
        returncode = rank0.wait(timeout=240)
        rank1 = int(pids[1].read_text())
        deadline = time.monotonic() + 5  # a SIGKILL takes effect soon, not at once
        while not ended(rank1) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ended(rank1), (
            f"rank 1 is still running after rank 0 ended (exit code {returncode}); rank 0's "
            f"log ends with:\n{(out_dir / 'rank0.log').read_text()[-3000:]}"
        )
        hang_to_end = time.time() - float((out_dir / "hung_at").read_text())
    finally:
        if rank0.poll() is None:
            rank0.kill()
        for pid_file in pids:  # a stopped rank that nothing ended: end it here
            if pid_file.exists():
                kill_if_ours(int(pid_file.read_text()))
    logs = [(out_dir / f"rank{rank}.log").read_text() for rank in (0, 1)]
    return HungRun(returncode, hang_to_end, logs)


def ended(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")  # a zombie has ended; only its parent's wait is missing


def kill_if_ours(pid: int) -> None:
    try:
        if not ended(pid) and SCRIPT.name in Path(f"/proc/{pid}/cmdline").read_text():
            os.kill(pid, signal.SIGKILL)
    except (FileNotFoundError, ProcessLookupError):
        pass


def assert_ended_in_time(run: HungRun) -> None:
    assert run.returncode != 0
    assert run.hang_to_end < STEP_TIMEOUT + MARGIN


def test_a_rank_stopped_inside_a_task_is_reported_with_the_collective_the_other_waits_in(tmp_path):
    run = run_with_rank_1_hung("task", tmp_path / "out")
    assert_ended_in_time(run)
    assert run.returncode == WATCHDOG_EXIT_CODE
    report = run.logs[0]
    assert "StepTimeout: rank 0: step 6 did not finish within 5 s; what each thread was doing:" in report
    assert "thread 'compute': running task 'backward' on batch 6" in report
    assert "torchrec/distributed/comm_ops.py" in report  # the stack: TorchRec's all-to-all backward
    assert "thread 'io': idle" in report and "thread 'loader': idle" in report
    assert "thread 'caller': waiting for the step barrier of step 6, on thread 'MainThread'" in report
    assert "collectives this rank issued that have not completed:" in report
    assert "flight recorder: gloo:all_to_all" in report and "(default_pg)" in report
    assert "by thread 'hstu-compute'" in report
    assert "engine: task 'backward' on batch 6 (thread 'compute') launches collectives and has not returned" in report
    assert "local rank 1 (pid" in report and "killed" in report  # stopped: only a SIGKILL ends it


def test_a_rank_stopped_in_its_loader_is_reported_in_the_per_batch_agreement(tmp_path):
    run = run_with_rank_1_hung("agreement", tmp_path / "out")
    assert_ended_in_time(run)
    assert run.returncode == WATCHDOG_EXIT_CODE
    report = run.logs[0]
    assert (
        "LoaderTimeout: rank 0: the data loader (train dataloader (DataLoader of Batches)) gave no batch within 5 s"
    ) in report
    assert "thread 'loader': pulling batch" in report
    assert "in wait_for_all_ranks" in report  # the agreement is where the pull waits
    assert "flight recorder: gloo:all_reduce" in report and "(hstu_loader_agreement)" in report
    assert "by thread 'hstu-loader'" in report
    assert "local rank 1 (pid" in report and "killed" in report


def test_a_loader_that_never_returns_is_reported_by_its_own_rank_and_the_other(tmp_path):
    run = run_with_rank_1_hung("loader", tmp_path / "out")
    assert_ended_in_time(run)
    stuck, waiting = run.logs[1], run.logs[0]
    assert (
        "LoaderTimeout: rank 1: the data loader (train dataloader (DataLoader of Batches)) gave no batch within 5 s"
    ) in stuck
    assert "in __iter__" in stuck and "threading.Event().wait()" in stuck  # where the loader hangs
    assert "collectives this rank issued that have not completed: none" in stuck
    assert f"rank 1: ending the process after its step timeout (exit code {WATCHDOG_EXIT_CODE})" in stuck
    # rank 0's own loader timeout, or rank 1's, noted in the store and read by rank 0's watchdog first
    assert "LoaderTimeout: rank 0: the data loader" in waiting or (
        "cannot finish: rank 1 failed: LoaderTimeout: rank 1: the data loader" in waiting
    ), waiting[-3000:]
    assert "(hstu_loader_agreement)" in waiting


def test_a_caller_stuck_in_a_collective_is_reported_by_the_watchdog_which_ends_the_process(tmp_path):
    run = run_with_rank_1_hung("caller", tmp_path / "out")
    assert_ended_in_time(run)
    assert run.returncode == WATCHDOG_EXIT_CODE
    report = run.logs[0]
    assert (
        "CallerTimeout: rank 0: the caller's thread did not return from before_step(6) "
        "(EngineEpochLoop._before_step) within 5 s (step 6)"
    ) in report
    assert "in on_train_batch_start" in report and "dist.all_reduce(torch.ones(1, device=self.device))" in report
    assert "flight recorder: gloo:all_reduce" in report and "(default_pg)" in report
    assert "by thread 'MainThread'" in report
    assert "rank 0: the caller's thread is the one that hangs: nothing can be raised there" in report
    assert "local rank 1 (pid" in report and "killed" in report


def test_a_rank_that_fails_ends_the_others_steps_with_its_error_not_the_timeout(tmp_path):
    """Rank 1's training_step raises and its process stays (on NCCL the others do not see a rank end): rank 0's
    step waited in the gradients' all-reduce until the step timeout (60 s here, 600 by default), then reported
    a hang. Now rank 1 leaves its failure in the process group's store and rank 0's watchdog ends the step with
    it, naming rank 1's error, well before the timeout."""
    from ranks import run_script

    script = SCRIPT.parent / "peer_failure_two_ranks.py"
    result = run_script(script, tmp_path, tmp_path, timeout=55)  # under the step timeout: the timeout never fires
    assert result.returncode != 0
    stderr = result.stderr
    assert "rank 1: TaskError: task 'forward' failed on batch 3" in stderr, stderr[-3000:]
    assert "ValueError: injected failure on rank 1 at batch 3" in stderr
    assert "rank 0: step 3 cannot finish: rank 1 failed: TaskError: task 'forward' failed on batch 3" in stderr, stderr[
        -3000:
    ]
    assert "did not finish within" not in stderr  # not the timeout's report


def test_a_rank_that_fails_in_validation_ends_the_others_with_its_error(tmp_path):
    """Rank 1's validation_step raises inside the first epoch (its process stays, as on NCCL); rank 0 finished
    its validation batches and waited in the reduction of the loss it logged with ``sync_dist``, outside any
    step: it waited until rank 1's process ended (40 s here; on NCCL, with the rank still there, the process
    group's timeout). Now the strategy's collectives between steps run under the step timeout: rank 0's
    watchdog reads rank 1's failure, reports where rank 0 waits, and ends the process."""
    from ranks import run_script

    script = SCRIPT.parent / "peer_failure_two_ranks.py"
    result = run_script(script, tmp_path, tmp_path, "validation", timeout=55)
    # rank 1's end (40 s after its failure) would close gloo's connection: rank 0 would then exit with 1
    stderr = result.stderr
    assert result.returncode == WATCHDOG_EXIT_CODE, stderr[-3000:]
    assert "rank 1: ValueError: injected failure on rank 1 at validation batch 0" in stderr, stderr[-3000:]
    assert "cannot finish: rank 1 failed: ValueError: injected failure on rank 1 at validation batch 0" in stderr
    assert "reducing a tensor over the ranks (reduce_op 'mean'), on thread 'MainThread'" in stderr
    assert "rank 0: ending the process after another rank's failure" in stderr


@pytest.mark.parametrize(
    "mode, failure",
    [("epoch_end", "at the end of epoch 0"), ("start", "before the first epoch")],
)
def test_a_rank_that_fails_between_epochs_ends_the_others_with_its_error(mode, failure, tmp_path):
    """Rank 1 raises outside the steps and its process stays: in its on_train_epoch_end after epoch 0
    (``epoch_end``), or in its on_train_start (``start``). Rank 0 went on to the next epoch and waited in the
    ranks' agreement on its number of batches, outside any watch (epoch 0's came before the engine and its step
    timeout existed), until rank 1's process ended (or the process groups' timeout on NCCL: 2 x step_timeout +
    60 s). Now the engine starts before the first epoch's agreement and every agreement runs under its watch."""
    from ranks import run_script

    script = SCRIPT.parent / "peer_failure_two_ranks.py"
    result = run_script(script, tmp_path, tmp_path, mode, timeout=55)
    stderr = result.stderr
    assert result.returncode == WATCHDOG_EXIT_CODE, stderr[-3000:]
    assert f"cannot finish: rank 1 failed: ValueError: injected failure on rank 1 {failure}" in stderr
    assert "agreeing on the epoch's number of batches with the other ranks, on thread 'MainThread'" in stderr
