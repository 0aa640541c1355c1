import threading

import pytest


def engine_threads():
    return [t.name for t in threading.enumerate() if t.name.startswith("hstu-") and t.is_alive()]


@pytest.fixture
def no_thread_left():
    """Fails the test if an engine thread is still alive when it ends."""
    yield
    assert engine_threads() == []
