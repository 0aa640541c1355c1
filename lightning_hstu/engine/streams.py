"""CUDA streams and per-(task, batch) events for the engine; on CPU every operation is a no-op.

Stream, current device and autocast are thread-local in PyTorch, so each worker enters its device
itself (``enter_thread``) and each task runs under its own stream (``use``).
"""

import contextlib
import dataclasses
import threading
from typing import Any

from ..plan import Stream


class NullStreams:
    """No CUDA: tasks run on the host only and need no events."""

    enabled = False

    def enter_thread(self) -> None:
        pass

    def stream(self, which: Stream) -> None:
        return None


class CudaStreams:
    """One CUDA stream per plan stream on one device; ``default`` is the caller's current stream."""

    enabled = True

    def __init__(self, device: Any):
        import torch

        self._torch = torch
        self._local = threading.local()  # per thread: the plan streams that are its current stream
        device = torch.device(device)
        # Workers call set_device, which needs an index: "cuda" means the caller's current device.
        self.device = device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
        self._streams = {
            s: (
                torch.cuda.current_stream(self.device) if s == Stream.DEFAULT else torch.cuda.Stream(device=self.device)
            )
            for s in Stream
        }

    def enter_thread(self) -> None:
        self._torch.cuda.set_device(self.device)
        current = self._torch.cuda.current_stream(self.device)
        self._local.current = frozenset(s for s, stream in self._streams.items() if stream == current)

    def stream(self, which: Stream) -> Any:
        return self._streams[which]

    def use(self, which: Stream) -> contextlib.AbstractContextManager:
        """Makes ``which`` the thread's current stream for a task; nothing to do where it already is the
        stream the thread entered with (a task's body leaves the current stream as it found it, as a
        ``with torch.cuda.stream(...)`` block does)."""
        if which in getattr(self._local, "current", ()):
            return contextlib.nullcontext()
        return self._torch.cuda.stream(self._streams[which])

    def record(self, which: Stream) -> Any:
        event = self._torch.cuda.Event()
        event.record(self._streams[which])
        return event

    def wait(self, which: Stream, event: Any) -> None:
        self._streams[which].wait_event(event)

    def keep_alive(self, value: Any, which: Stream) -> None:
        """Protect ``value``'s memory until the work queued so far on ``which`` is done.

        The caching allocator would otherwise reuse a tensor made on the producer's stream as soon as
        the producer frees it, while the consumer's stream may still be reading it.
        """
        _record_stream(value, self._streams[which], self._torch)


def _record_stream(value: Any, stream: Any, torch: Any) -> None:
    if isinstance(value, torch.Tensor):
        if value.is_cuda:
            value.record_stream(stream)
    elif hasattr(value, "record_stream"):  # KeyedJaggedTensor and other torchrec Pipelineables
        value.record_stream(stream)
    elif isinstance(value, dict):
        for item in value.values():
            _record_stream(item, stream, torch)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _record_stream(item, stream, torch)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            _record_stream(getattr(value, field.name), stream, torch)


def make_streams(device: Any) -> NullStreams | CudaStreams:
    """CUDA streams when ``device`` is a CUDA device, else the no-op set."""
    if device is None:
        return NullStreams()
    import torch

    device = torch.device(device)
    return CudaStreams(device) if device.type == "cuda" else NullStreams()
