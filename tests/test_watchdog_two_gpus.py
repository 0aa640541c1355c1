"""The watchdog on two GPUs with NCCL (docs/watchdog.md): ``lightning-hstu fit`` on the synthetic benchmark,
rank 1 stopped with SIGSTOP from outside mid-training (wherever it happens to be: the host runs ahead of
the kernels), and rank 0 must report within ``step_timeout + 10`` s, naming the collective it waits in,
and end. Then the precise hangs of test_watchdog_ranks.py on NCCL, with the toy recommender (no TorchRec
needed). Skipped unless two CUDA devices are visible.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
        python -m pytest -q -rs tests/test_watchdog_two_gpus.py
"""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ranks import launch_env
from test_watchdog_ranks import MARGIN, run_with_rank_1_hung
from test_watchdog_ranks import STEP_TIMEOUT as PRECISE_STEP_TIMEOUT

ROOT = Path(__file__).parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "fit_noting_steps.py"
STEP_TIMEOUT = 30
REPORT = re.compile(r"(StepTimeout|LoaderTimeout|CallerTimeout): rank 0: ")
PENDING = re.compile(
    r"flight recorder: (nccl|gloo):\w+ #\d+ on process group|engine: task '\w+' on batch \d+ "
    r"(returned, but its work on stream|\(thread)"
)


def fit_and_stop_rank_1(out_dir: Path, accelerator: str, step_timeout: float, steps_before_stop: int = 30):
    """Runs the two-rank fit, stops rank 1 once both ranks are ``steps_before_stop`` steps in; returns
    (rank 0's output, seconds from the stop to rank 0's report, seconds to rank 0's end, its exit code)."""
    out_dir.mkdir()
    env = launch_env()
    for variable in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        env.setdefault(variable, "0" if variable == "NCCL_NVLS_ENABLE" else "1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    note = '{"class_path": "fit_noting_steps.NoteSteps", "init_args": {"directory": "%s"}}' % out_dir
    command = [
        sys.executable,
        str(SCRIPT),
        "fit",
        "--config",
        str(ROOT / "examples" / "benchmark_synthetic.yaml"),
        f"--trainer.accelerator={accelerator}",
        "--trainer.devices=2",
        "--trainer.max_epochs=500",
        f"--trainer.strategy.init_args.step_timeout={step_timeout}",
        f"--trainer.callbacks+={note}",
    ]
    log_path = out_dir / "ranks.log"
    rank1 = None
    with open(log_path, "w") as log:
        rank0 = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=out_dir, env=env)
    try:
        deadline = time.monotonic() + 600
        while min(_step(out_dir, 0)[1], _step(out_dir, 1)[1]) < steps_before_stop:
            assert rank0.poll() is None, log_path.read_text()[-5000:]
            assert time.monotonic() < deadline, "training did not reach the step to stop at"
            time.sleep(0.5)
        rank1 = _step(out_dir, 1)[0]
        os.kill(rank1, signal.SIGSTOP)
        stopped = time.monotonic()
        reported = None
        while rank0.poll() is None and time.monotonic() < stopped + step_timeout + 60:
            if reported is None and REPORT.search(log_path.read_text()):
                reported = time.monotonic()
            time.sleep(0.2)
        ended = time.monotonic()
        if reported is None and REPORT.search(log_path.read_text()):
            reported = ended
        return (log_path.read_text(), None if reported is None else reported - stopped, ended - stopped, rank0.poll())
    finally:
        if rank0.poll() is None:
            rank0.kill()
        if rank1 is not None:
            try:
                os.kill(rank1, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _step(out_dir: Path, rank: int) -> tuple[int, int]:
    try:
        pid, step = (out_dir / f"rank{rank}.step").read_text().split()
    except (FileNotFoundError, ValueError):
        return 0, -1
    return int(pid), int(step)


two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")


@two_gpus
def test_a_rank_stopped_on_nccl_is_reported_naming_the_collective_and_the_job_ends(tmp_path):
    output, to_report, to_end, returncode = fit_and_stop_rank_1(tmp_path / "out", "gpu", STEP_TIMEOUT)
    tail = output[-8000:]
    print(f"rank 1 stopped: rank 0 reported after {to_report} s and ended after {to_end:.1f} s")  # pytest -s
    assert to_report is not None, f"rank 0 reported nothing within {STEP_TIMEOUT + 60} s:\n{tail}"
    assert to_report <= STEP_TIMEOUT + 10, tail
    assert PENDING.search(output), tail  # the collective rank 0 waits in
    assert returncode is not None and returncode != 0, tail
    assert to_end <= STEP_TIMEOUT + 10, tail  # the job ends within step_timeout + 10 s, report included


@two_gpus
@pytest.mark.parametrize("scenario", ["toy_task", "caller", "agreement"])
def test_a_rank_stopped_at_a_precise_point_on_nccl_is_reported_and_the_job_ends(scenario, tmp_path):
    """Where rank 0 blocks on NCCL depends on how far its host ran ahead (a host synchronisation in a task,
    Lightning's SIGTERM broadcast on the caller's thread, the agreement): any of the three reports will do,
    as long as it names a collective in flight."""
    run = run_with_rank_1_hung(scenario, tmp_path / "out", "gpu")
    report = run.logs[0]
    assert REPORT.search(report), report[-8000:]
    assert PENDING.search(report), report[-8000:]
    assert run.returncode != 0
    assert run.hang_to_end < PRECISE_STEP_TIMEOUT + MARGIN
