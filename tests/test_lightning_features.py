"""More of what Lightning users rely on, under the strategy (the basics, with clipping, bf16, validation,
checkpoints and early stopping, are in test_strategy_lightning.py): callbacks that change the weights or the
accumulation between epochs, schedulers that watch a metric or step every few batches, a module's own
clipping and zero_grad, hooks that log around backward, a training_step that skips batches, an
on_train_batch_start that ends the epoch, iterable datasets, overfit_batches and fast_dev_run. Each trains
as under Lightning's own loop: the same batches, hook calls (with their outputs, gradients and learning
rates), logged rows, callback metrics and weights. A module drawing from torch's global generator in its step
(dropout) trains as under Lightning's DDP strategy, whose seeding at setup the strategy keeps."""

import pytest
import torch
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import GradientAccumulationScheduler, LearningRateMonitor, StochasticWeightAveraging
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from lightning_runs import RecordingLogger, assert_same_weights, fit

from lightning_hstu import HSTUPipelineStrategy
from lightning_hstu.data.toy import ToyDataModule
from lightning_hstu.models.toy import ToyRecommender


class Events(Callback):
    """What the callbacks are told, with the values a user's callback would read there."""

    def __init__(self):
        self.events = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if isinstance(outputs, dict):
            outputs = {key: float(value) for key, value in outputs.items()}
        self.events.append(("end", batch_idx, trainer.global_step, outputs))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        norm = sum(float(p.grad.norm()) for p in pl_module.parameters() if p.grad is not None)
        self.events.append(("before_optimizer_step", trainer.global_step, norm, optimizer.param_groups[0]["lr"]))

    def on_train_epoch_end(self, trainer, pl_module):
        metrics = {key: float(value) for key, value in trainer.callback_metrics.items()}
        self.events.append(("epoch_end", trainer.current_epoch, trainer.global_step, metrics))


class SkipsOddBatches(ToyRecommender):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return None if batch_idx % 2 else loss


class ReturnsADict(ToyRecommender):
    def training_step(self, batch, batch_idx):
        return {"loss": super().training_step(batch, batch_idx), "index": torch.tensor(float(batch_idx))}


class EndsTheEpochAtBatch5(ToyRecommender):
    def on_train_batch_start(self, batch, batch_idx):
        return -1 if batch_idx == 5 else None


class ClipsItself(ToyRecommender):
    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.clip_gradients(optimizer, gradient_clip_val=0.05, gradient_clip_algorithm="norm")


class ZeroesWithoutNone(ToyRecommender):
    def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
        optimizer.zero_grad(set_to_none=False)


class LogsAroundBackward(ToyRecommender):
    def on_before_backward(self, loss):
        self.log("before_backward", loss.detach())

    def on_after_backward(self):
        self.log("grad_norm", sum(p.grad.norm() for p in self.parameters() if p.grad is not None))


class WithDropout(ToyRecommender):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.mlp.insert(1, nn.Dropout(0.3))


class OnPlateau(ToyRecommender):
    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        # mode="max" on a falling loss: no improvement at any epoch, so the rate is halved after each
        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="max", patience=0, factor=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "monitor": "train_loss"}}


class EveryThirdStep(ToyRecommender):
    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=0.01)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.9)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 3}}


class FromAnIterable(ToyDataModule):
    """The toy batches from an IterableDataset: a loader without a length."""

    def train_dataloader(self):
        items, ratings, size = self.items, self.ratings, self.hparams.batch_size

        class Batches(IterableDataset):
            def __iter__(self):
                for start in range(0, len(items), size):
                    yield items[start : start + size], ratings[start : start + size]

        return DataLoader(Batches(), batch_size=None)


SCENARIOS = {  # model, Trainer options, callbacks made per fit, data module; RecordingLogger always
    "stochastic weight averaging": (ToyRecommender, {"max_epochs": 4}, [lambda: StochasticWeightAveraging(0.01, 2)]),
    "accumulation scheduled by epoch": (
        ToyRecommender,
        {"max_epochs": 3},
        [lambda: GradientAccumulationScheduler({0: 2, 1: 3})],
    ),
    "ReduceLROnPlateau on a logged metric": (OnPlateau, {"max_epochs": 4}, []),
    "a scheduler every third step, accumulating": (EveryThirdStep, {"max_epochs": 3, "accumulate_grad_batches": 2}, []),
    "learning rates logged by LearningRateMonitor": (
        ToyRecommender,
        {"log_every_n_steps": 1},
        [lambda: LearningRateMonitor("step")],
    ),
    "training_step returning None for some batches": (SkipsOddBatches, {}, []),
    "training_step returning a dict": (ReturnsADict, {}, []),
    "on_train_batch_start returning -1": (EndsTheEpochAtBatch5, {}, []),
    "the module's own configure_gradient_clipping": (ClipsItself, {}, []),
    "the module's own optimizer_zero_grad": (ZeroesWithoutNone, {}, []),
    "self.log in on_before_backward and on_after_backward": (LogsAroundBackward, {"log_every_n_steps": 2}, []),
    "an IterableDataset": (ToyRecommender, {}, [], FromAnIterable),
    "overfit_batches": (ToyRecommender, {"overfit_batches": 2, "max_epochs": 3}, []),
    "fast_dev_run": (ToyRecommender, {"fast_dev_run": 3}, []),
}


def run(strategy, scenario):
    model_cls, options, callbacks, *data = SCENARIOS[scenario]
    events, logger = Events(), RecordingLogger()
    model, trainer = fit(
        strategy,
        model_cls=model_cls,
        data_cls=data[0] if data else ToyDataModule,
        logger=logger,
        callbacks=[events, *(make() for make in callbacks)],
        **options,
    )
    metrics = {key: float(value) for key, value in trainer.callback_metrics.items()}
    return model, trainer, events.events, logger.rows, metrics


_lightnings = {}


def lightnings(scenario):
    """The scenario under Lightning's own loop (one fit per scenario and test session)."""
    if scenario not in _lightnings:
        _lightnings[scenario] = run("auto", scenario)
    return _lightnings[scenario]


@pytest.mark.usefixtures("no_thread_left")
@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("preset", ["legacy_none", "default_d6"])
def test_the_preset_trains_like_lightnings_own_loop(preset, scenario):
    e_model, e_trainer, e_events, e_rows, e_metrics = lightnings(scenario)
    model, trainer, events, rows, metrics = run(HSTUPipelineStrategy(preset), scenario)
    assert events == e_events
    assert rows == e_rows
    assert metrics == e_metrics
    assert (trainer.current_epoch, trainer.global_step) == (e_trainer.current_epoch, e_trainer.global_step)
    assert model.batches_seen == e_model.batches_seen
    assert_same_weights(model, e_model)


def test_the_scenarios_reach_what_they_exercise():
    """Each scenario does what it is there for under Lightning's own loop (else the comparison above says
    nothing about it)."""
    swa = lightnings("stochastic weight averaging")[1]
    assert any(isinstance(c, StochasticWeightAveraging) and c.n_averaged > 0 for c in swa.callbacks)
    plateau = lightnings("ReduceLROnPlateau on a logged metric")[1]
    assert plateau.optimizers[0].param_groups[0]["lr"] < 0.05
    stopped = lightnings("on_train_batch_start returning -1")[2]
    assert max(e[1] for e in stopped if e[0] == "end") == 4  # batches 0-4 of each epoch, not 12
    skipping = lightnings("training_step returning None for some batches")[2]
    assert [e[3] == {} for e in skipping if e[0] == "end"] == [i % 2 == 1 for i in range(12)] * 2  # no outputs
    lr_rows = lightnings("learning rates logged by LearningRateMonitor")[3]
    assert any("lr-SGD" in row for _, row in lr_rows)
    logged = lightnings("self.log in on_before_backward and on_after_backward")[3]
    assert any("grad_norm" in row and "before_backward" in row for _, row in logged)


class SeesItsLossAtBackward(ToyRecommender):
    """Keeps, per batch, the loss its training_step returned and the loss on_before_backward is given."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.losses = []

    def training_step(self, batch, batch_idx):
        self.losses.append([super().training_step(batch, batch_idx)])
        return self.losses[-1][0]

    def on_before_backward(self, loss):
        self.losses[-1].append(loss)


@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("strategy", ["auto", "legacy_none"])
def test_backward_gets_the_loss_training_step_returned_divided_only_when_accumulating(strategy, accumulate):
    """Lightning divides the loss by ``accumulate_grad_batches`` before backward. Under the strategy a division
    by 1 is not made (it was a kernel in the step's forward and one in its backward): backward gets the very
    tensor training_step returned; accumulating, it gets the quotient, as under Lightning's own loop."""
    losses = fit(
        strategy if strategy == "auto" else HSTUPipelineStrategy(strategy),
        model_cls=SeesItsLossAtBackward,
        max_epochs=1,
        limit_train_batches=4,
        accumulate_grad_batches=accumulate,
    )[0].losses
    assert len(losses) == 4 and all(len(pair) == 2 for pair in losses)
    for returned, given in losses:
        assert torch.equal(given, returned / accumulate)
        assert (given is returned) == (strategy != "auto" and accumulate == 1)


@pytest.mark.parametrize("preset", ["legacy_none", "default_d6"])
def test_dropout_draws_as_under_lightnings_ddp_strategy(preset):
    """Lightning's DDPStrategy, and this strategy built on it, seeds torch's generators again when it sets
    up (``reset_seed``, from the ``seed_everything`` seed): the step's dropout masks then come from the seed,
    not from the generator's state after the model's initialisation, as under the single-device default.
    So a module with dropout trains bitwise as under ``strategy="ddp"``, and differently from "auto"."""
    ddp, auto = fit("ddp", model_cls=WithDropout), fit("auto", model_cls=WithDropout)
    model, _ = fit(HSTUPipelineStrategy(preset), model_cls=WithDropout)
    assert_same_weights(model, ddp[0])
    assert not torch.equal(model.mlp[0].weight, auto[0].mlp[0].weight)
