"""The strategy on one CUDA device: Lightning's batch transfer runs on the memcpy stream of the io thread,
training_step on the default stream, and training matches Lightning's own loop on the same GPU. Skipped
without CUDA (CI has none); run on the GPU machine."""

import pytest
import torch

from lightning_runs import fit

from lightning_hstu import PRESET_NAMES, HSTUPipelineStrategy
from lightning_hstu.models.toy import ToyRecommender

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


class StreamProbe(ToyRecommender):
    def on_fit_start(self):
        self.seen_streams, self.default_stream = set(), torch.cuda.current_stream()

    def transfer_batch_to_device(self, batch, device, dataloader_idx):
        if self.trainer.training:  # validation batches are Lightning's own business
            self.transfer_streams = getattr(self, "transfer_streams", set())
            self.transfer_streams.add(torch.cuda.current_stream())
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    def training_step(self, batch, batch_idx):
        self.seen_streams.add(torch.cuda.current_stream())
        assert batch[0].is_cuda
        return super().training_step(batch, batch_idx)


@pytest.fixture(scope="module")
def lightning_on_gpu():
    return fit("auto", model_cls=ToyRecommender, accelerator="cuda")


@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_preset_on_cuda_trains_like_lightning(preset, lightning_on_gpu):
    expected, _ = lightning_on_gpu
    strategy = HSTUPipelineStrategy(preset)
    model, trainer = fit(strategy, model_cls=StreamProbe, accelerator="cuda")
    assert model.batches_seen == expected.batches_seen
    assert model.seen_streams == {model.default_stream}
    # one side stream for every transfer (the engine's memcpy stream), never the default stream
    assert len(model.transfer_streams) == 1 and model.default_stream not in model.transfer_streams
    for name, value in expected.state_dict().items():
        # the embedding backward accumulates with atomics on the GPU: equal up to summation order
        torch.testing.assert_close(model.state_dict()[name], value, rtol=1e-5, atol=1e-6)


def test_device_time_is_measured_per_task_on_its_stream():
    from lightning_hstu.callbacks import TaskTimingCallback

    timing = TaskTimingCallback(log_every_n_steps=0, device_time=True)
    fit(HSTUPipelineStrategy("full_split_d6"), callbacks=[timing], accelerator="cuda", max_epochs=1)
    assert set(timing.device_ms) == {r.task for r in timing.records}
    assert all(len(ms) == 12 for ms in timing.device_ms.values())
    assert all(t >= 0 for ms in timing.device_ms.values() for t in ms)
    assert sum(timing.device_ms["forward"]) > 0
