import os
import threading
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run in Triton's CPU interpreter (slow: the kernel tests keep their shapes tiny). Set
    # before anything imports triton.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def engine_threads():
    return [t.name for t in threading.enumerate() if t.name.startswith("hstu-") and t.is_alive()]


@pytest.fixture(autouse=True)
def no_process_group_without_a_cpu_backend():
    """A GPU test's fit leaves its NCCL default process group in the process (Lightning destroys it at exit
    only), and the strategy refuses a CPU fit on it: destroyed after the test, so that the CPU tests after it
    make their own. Groups that serve CPU tensors (the CPU tests' gloo) are kept, as Lightning keeps them."""
    yield
    from lightning_hstu.strategies.process_groups import default_group_backends

    backends = default_group_backends()
    if backends and "cpu" not in backends:
        torch.distributed.destroy_process_group()


WRITTEN_BY_LIGHTNING = ("checkpoints", "lightning_logs")
"""What Lightning writes under its ``default_root_dir``, the working directory unless a test gives one."""


@pytest.fixture(autouse=True)
def nothing_written_to_the_working_directory():
    """Fails the test that leaves a checkpoint folder or a log folder in the working directory (a fit with
    checkpointing on and no ``default_root_dir``): a test's files belong under its ``tmp_path``."""
    before = {name: _entries(Path(name)) for name in WRITTEN_BY_LIGHTNING}
    yield
    for name, entries in before.items():
        new = _entries(Path(name)) - entries
        assert not new, f"the test wrote {sorted(new)[:3]} under {Path(name).resolve()}; give it a tmp_path"


def _entries(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir()} if folder.is_dir() else set()


@pytest.fixture
def no_thread_left():
    """Fails the test if an engine thread is still alive when it ends."""
    yield
    assert engine_threads() == []
