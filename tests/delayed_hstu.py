"""HSTU recommenders whose tasks are delayed at random: what makes a missing wait between tasks show in the
weights (also imported by tests/scripts/)."""

import random
import time

import torch

from lightning_hstu.hstu.batch import HSTUBatch
from lightning_hstu.hstu.sparse import InputDist
from lightning_hstu.models.hstu import HSTURecommender


class DelayedTasks(HSTURecommender):
    """Delays the side-chain tasks at random, on the host (their threads) and, on a GPU, on their streams:
    a consumer on another stream that did not wait for its producer's event would read unfinished data.
    The delays differ by ``delay_seed`` and by rank."""

    delay_seed = 0

    def on_fit_start(self):
        self._delays = random.Random(f"{self.delay_seed}/{self.global_rank}")

    def _delay(self):
        time.sleep(self._delays.uniform(0, 0.004))
        if self.device.type == "cuda":
            torch.cuda._sleep(self._delays.randrange(4_000_000))  # about 0-2 ms of GPU time on the task's stream

    def transfer_batch_to_device(self, batch, device, dataloader_idx):
        if device.type == "cuda":
            # The h2d task, on the memcpy stream: its copy lands up to ~20 ms later than the host moves on.
            torch.cuda._sleep(self._delays.randrange(20_000_000, 40_000_000))
        else:
            time.sleep(self._delays.uniform(0, 0.004))
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    def hstu_finish_shuffle(self, b):
        self._delay()
        super().hstu_finish_shuffle(b)

    def hstu_wait_input_dist(self, b):
        self._delay()
        super().hstu_wait_input_dist(b)

    def hstu_compute_output_dist(self, b):
        self._delay()
        super().hstu_compute_output_dist(b)


class LateOutputs(DelayedTasks):
    """On a GPU, besides the delays, the ids that finish_shuffle and wait_input_dist hand to other streams are
    zeroed and written again on the task's own stream, 10-20 ms of GPU time apart, at the end of the task.

    With several ranks these tasks wait on the host for their collectives (the shuffle's costs, TorchRec's
    splits), which absorbs a delay put before them; zeroing after the last such wait leaves the output
    unfinished on the producer's stream while the host moves on, so that a consumer on another stream that
    did not wait for the task's event reads zeros (id 0 is a valid row: the run goes on, with other weights).
    """

    def hstu_finish_shuffle(self, b):
        written = _Writes(b)
        super().hstu_finish_shuffle(written)
        self._land_late(written.slots["shuffled_batch"])

    def hstu_wait_input_dist(self, b):
        written = _Writes(b)
        super().hstu_wait_input_dist(written)
        self._land_late(written.slots["sparse_input"])

    def _land_late(self, output):
        if self.device.type != "cuda":
            return  # on the host a task's output is complete when the task returns
        for ids in _ids_of(output):
            written = ids.clone()
            ids.zero_()
            torch.cuda._sleep(self._delays.randrange(20_000_000, 40_000_000))
            ids.copy_(written)


class _Writes:
    """A task's batch view that also keeps what the task writes (the view itself lets it read only its inputs)."""

    def __init__(self, view):
        self.view, self.slots = view, {}

    @property
    def index(self) -> int:
        return self.view.index

    def __getitem__(self, slot):
        return self.view[slot]

    def __setitem__(self, slot, value):
        self.view[slot] = self.slots[slot] = value


def _ids_of(output) -> list[torch.Tensor]:
    if isinstance(output, HSTUBatch):
        return [output.features.values()]
    if isinstance(output, InputDist):  # TorchRec's distributed features: one KeyedJaggedTensor per sharding
        return [features.values() for features in output.pending]
    raise TypeError(f"no ids known in {type(output).__name__}")
