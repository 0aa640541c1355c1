"""Lightning's ``ThroughputMonitor`` set up for ``HSTUBatch`` batches and a stated peak."""

from lightning.pytorch.callbacks import ThroughputMonitor


def histories(batch) -> int:
    """Samples of an ``HSTUBatch``: its histories."""
    return batch.size


def events(batch) -> int:
    """Items of an ``HSTUBatch``: the events of its histories (synchronises the device on a GPU batch)."""
    return int(batch.sequence_lengths().sum())


class HSTUThroughputMonitor(ThroughputMonitor):
    """``ThroughputMonitor`` whose samples are histories and items their events, logging under ``train/`` (and
    ``validate/``) ``samples``, ``lengths`` (events), ``device/samples_per_sec``, ``device/items_per_sec``
    and, from the module's ``flops_per_batch``, ``device/flops_per_sec`` and ``device/mfu``.

    ``peak_flops``: one device's peak that MFU divides by; None takes Lightning's table, which knows no H200
    (no MFU is logged there) and lists the sparse bf16 peak of the H100 (2e15, twice the dense 989e12 that
    BENCHMARKS.md divides by). Every step it waits for the device: a measuring tool, not one to train for
    speed with. ``**kwargs`` go to Lightning's ``Throughput`` (``window_size``, ``separator``)."""

    def __init__(self, peak_flops: float | None = None, **kwargs):
        super().__init__(batch_size_fn=histories, length_fn=events, **kwargs)
        if peak_flops is not None and not peak_flops > 0:
            raise ValueError(f"peak_flops must be greater than 0 (or None: Lightning's table), got {peak_flops!r}")
        self.peak_flops = peak_flops

    def setup(self, trainer, pl_module, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if self.peak_flops is not None:
            self.available_flops = self.peak_flops
            for throughput in self._throughputs.values():
                throughput.available_flops = self.peak_flops
