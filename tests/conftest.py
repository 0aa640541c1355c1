import os
import threading

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run in Triton's CPU interpreter (slow: the kernel tests keep their shapes tiny). Set
    # before anything imports triton.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def engine_threads():
    return [t.name for t in threading.enumerate() if t.name.startswith("hstu-") and t.is_alive()]


@pytest.fixture
def no_thread_left():
    """Fails the test if an engine thread is still alive when it ends."""
    yield
    assert engine_threads() == []
