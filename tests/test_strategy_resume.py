"""Resuming from a checkpoint taken mid-epoch gives the run that never stopped, although the
ring had pulled depth - 1 batches ahead when the checkpoint was taken: no batch skipped, none repeated.

The loaders have a deterministic order: a plain DataLoader shuffled by Lightning's DistributedSampler
(its order depends on the epoch only), and a StatefulDataLoader in order. (A StatefulDataLoader shuffled
by its own generator, or under a DistributedSampler, does not come back to the same order after a resume
under Lightning's own loop either.)
"""

import os
import signal
import time

import pytest
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, OnExceptionCheckpoint
from torch.utils.data import IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_runs import assert_same_weights, fit

from lightning_hstu import HSTUPipelineStrategy
from lightning_hstu.data.toy import ToyDataModule
from lightning_hstu.loops import CheckpointError
from lightning_hstu.models.toy import ToyRecommender

LOADERS = {
    "plain DataLoader, shuffled by DistributedSampler": (dict(shuffle=True), dict(use_distributed_sampler=True)),
    "StatefulDataLoader": (dict(stateful=True), {}),
}


def interrupted_run(preset, tmp_path, at_step, data, trainer_kwargs, total=24):
    saver = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=at_step, save_top_k=-1, filename="{step}")
    first, trainer = fit(
        HSTUPipelineStrategy(preset),
        data_kwargs=data,
        max_steps=at_step,
        enable_checkpointing=True,
        callbacks=[saver],
        **trainer_kwargs,
    )
    assert trainer.global_step == at_step
    resumed, trainer = fit(
        HSTUPipelineStrategy(preset), data_kwargs=data, ckpt_path=tmp_path / f"step={at_step}.ckpt", **trainer_kwargs
    )
    assert trainer.global_step == total  # 2 epochs of 12 batches (or of limit_train_batches)
    return first, resumed


@pytest.mark.usefixtures("no_thread_left")
@pytest.mark.parametrize("loader", LOADERS)
@pytest.mark.parametrize("preset", ["legacy_none", "full_split_d6"])
def test_mid_epoch_resume_equals_the_uninterrupted_run(preset, loader, tmp_path):
    data, trainer_kwargs = LOADERS[loader]
    uninterrupted, _ = fit(HSTUPipelineStrategy(preset), data_kwargs=data, **trainer_kwargs)
    first, resumed = interrupted_run(preset, tmp_path, 5, data, trainer_kwargs)  # 5 of 12: mid-epoch
    assert first.batches_seen + resumed.batches_seen == uninterrupted.batches_seen
    assert_same_weights(resumed, uninterrupted)


AT_EPOCH_END = {
    **LOADERS,
    "StatefulDataLoader, shuffled by DistributedSampler": (
        dict(stateful=True, shuffle=True),
        LOADERS["plain DataLoader, shuffled by DistributedSampler"][1],
    ),
}


@pytest.mark.usefixtures("no_thread_left")
@pytest.mark.parametrize(
    "loader, limit, preset",
    [
        ("plain DataLoader, shuffled by DistributedSampler", None, "default_d6"),
        ("StatefulDataLoader", None, "legacy_none"),
        ("StatefulDataLoader", 10, "default_d6"),
        ("StatefulDataLoader, shuffled by DistributedSampler", None, "default_d6"),
    ],
)
def test_resume_at_the_end_of_an_epoch(loader, limit, preset, tmp_path):
    """A checkpoint saved at the end of the epoch's last batch (``every_n_train_steps`` landing there) resumes
    into a whole next epoch. With a StatefulDataLoader it saves the loader's state after it ended, or none
    where ``limit_train_batches`` ended the epoch first (a new pass from the start): the state after the last
    batch would make the next epoch the rest of this one (no batch, or the two past the limit), as it does
    under Lightning's own loop; and the next epoch's iterator is made again once the sampler has the new
    epoch (Lightning made it before: the ended epoch's order again)."""
    data, trainer_kwargs = AT_EPOCH_END[loader]
    trainer_kwargs = {**trainer_kwargs, **({} if limit is None else {"limit_train_batches": limit})}
    uninterrupted, _ = fit(HSTUPipelineStrategy(preset), data_kwargs=data, **trainer_kwargs)
    epoch = limit or 12
    first, resumed = interrupted_run(preset, tmp_path, epoch, data, trainer_kwargs, total=2 * epoch)
    assert first.batches_seen + resumed.batches_seen == uninterrupted.batches_seen
    assert [index for index, _ in resumed.batches_seen] == list(range(epoch))
    assert_same_weights(resumed, uninterrupted)


class Stream(IterableDataset):
    """An endless stream of the toy samples that goes on where it was at each new iterator (its position is
    its state: a StatefulDataLoader saves and restores it)."""

    def __init__(self, items, ratings):
        self.items, self.ratings, self.position = items, ratings, 0

    def __iter__(self):
        while True:
            index = self.position % len(self.items)
            self.position += 1
            yield self.items[index], self.ratings[index]

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


class StreamData(ToyDataModule):
    def train_dataloader(self):
        return StatefulDataLoader(Stream(self.items, self.ratings), batch_size=self.hparams.batch_size)


@pytest.mark.usefixtures("no_thread_left")
def test_a_stream_resumed_at_the_end_of_an_epoch_goes_on_where_it_was(tmp_path):
    """Epochs of ``limit_train_batches`` batches of an endless stream: a checkpoint at the end of an epoch keeps
    the stream's position (no new pass from its start, as a map-style loader gets), and the resumed fit trains
    the batches the uninterrupted one did."""
    options = {"limit_train_batches": 10}
    uninterrupted, _ = fit(HSTUPipelineStrategy("default_d6"), data_cls=StreamData, **options)
    saver = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=10, save_top_k=-1, filename="{step}")
    first, _ = fit(
        HSTUPipelineStrategy("default_d6"),
        data_cls=StreamData,
        max_steps=10,
        enable_checkpointing=True,
        callbacks=[saver],
        **options,
    )
    resumed, _ = fit(
        HSTUPipelineStrategy("default_d6"), data_cls=StreamData, ckpt_path=tmp_path / "step=10.ckpt", **options
    )
    assert first.batches_seen + resumed.batches_seen == uninterrupted.batches_seen
    assert_same_weights(resumed, uninterrupted)


class FailsAtStep(Callback):
    """Raises at the end of the batch after which the global step is ``step`` (that batch trained)."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            raise RuntimeError(f"failed at step {self.step}")


class FailsInTrainingStep(ToyRecommender):
    """Raises in ``training_step`` of batch 7 of the first epoch (that batch not trained), once."""

    fail = True

    def training_step(self, batch, batch_idx):
        if FailsInTrainingStep.fail and self.current_epoch == 0 and batch_idx == 7:
            FailsInTrainingStep.fail = False
            raise RuntimeError("failed at step 7")
        return super().training_step(batch, batch_idx)


@pytest.mark.usefixtures("no_thread_left")
@pytest.mark.parametrize("where", ["on_train_batch_end", "training_step"])
@pytest.mark.parametrize("preset", ["legacy_none", "default_d6"])
def test_a_checkpoint_saved_on_an_exception_resumes_at_the_first_batch_not_trained(preset, where, tmp_path):
    """Lightning's OnExceptionCheckpoint saves after the epoch loop has ended with the exception; with a
    StatefulDataLoader the checkpoint still holds the loader state from before the oldest batch not trained
    (not the state of the loader pulled ahead: the resume skipped 3 batches under legacy_none and the rest of
    the epoch under default_d6), and the resumed run ends as the uninterrupted one. The failure comes after
    batch 6 trained (in ``on_train_batch_end``) or while batch 7 trains (in ``training_step``: the resume
    lost batch 7, as Lightning's own loop does), so either way batch 7 is the first not trained."""
    data = dict(stateful=True)
    uninterrupted, _ = fit(HSTUPipelineStrategy(preset), data_kwargs=data)
    failing = dict(model_cls=FailsInTrainingStep) if where == "training_step" else dict(callbacks=[FailsAtStep(7)])
    FailsInTrainingStep.fail = True
    with pytest.raises(RuntimeError, match="failed at step 7"):
        fit(
            HSTUPipelineStrategy(preset),
            data_kwargs=data,
            enable_checkpointing=True,
            **{**failing, "callbacks": [*failing.get("callbacks", []), OnExceptionCheckpoint(tmp_path, "failed")]},
        )
    resumed, trainer = fit(HSTUPipelineStrategy(preset), data_kwargs=data, ckpt_path=tmp_path / "failed.ckpt")
    assert trainer.global_step == 24
    assert resumed.batches_seen == uninterrupted.batches_seen[7:]
    assert_same_weights(resumed, uninterrupted)


class CtrlCDuringOptimizerStep(Callback):
    """Ctrl-C (a SIGINT to the process) while the optimizer step of batch 6 runs on an engine thread; the caller,
    waiting at the step barrier, takes the KeyboardInterrupt before the step has returned."""

    def __init__(self):
        self.fired = False

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if not self.fired and trainer.fit_loop.epoch_loop.batch_idx == 6:
            self.fired = True
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.6)  # the rest of a slow step (clipping, an all-reduce): longer than the caller's poll


@pytest.mark.usefixtures("no_thread_left")
@pytest.mark.parametrize("preset", ["legacy_none", "default_d6"])
def test_an_interrupt_during_an_optimizer_step_is_saved_with_that_batch_trained(preset, tmp_path):
    """The step the interrupt could not stop is applied: the checkpoint saved on it counts the batch (it held
    the weights after batch 6 with the loader before it, and the resume trained batch 6 twice)."""
    data = dict(stateful=True)
    uninterrupted, _ = fit(HSTUPipelineStrategy(preset), data_kwargs=data)
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)  # a background job may ignore SIGINT
    try:
        with pytest.raises(SystemExit):  # Lightning's graceful shutdown after a KeyboardInterrupt
            fit(
                HSTUPipelineStrategy(preset),
                data_kwargs=data,
                enable_checkpointing=True,
                callbacks=[CtrlCDuringOptimizerStep(), OnExceptionCheckpoint(tmp_path, "interrupted")],
            )
    finally:
        signal.signal(signal.SIGINT, handler)  # Lightning ignores SIGINT from then on
    resumed, trainer = fit(HSTUPipelineStrategy(preset), data_kwargs=data, ckpt_path=tmp_path / "interrupted.ckpt")
    assert trainer.global_step == 24
    assert resumed.batches_seen == uninterrupted.batches_seen[7:]
    assert_same_weights(resumed, uninterrupted)


class FailsOneValidation(ToyRecommender):
    """Its validation at global step 8 raises once (at its second batch)."""

    armed = False

    def validation_step(self, batch, batch_idx):
        if FailsOneValidation.armed and self.global_step == 8 and batch_idx == 1:
            FailsOneValidation.armed = False
            raise RuntimeError("validation failed")
        return super().validation_step(batch, batch_idx)


class ValidatedAt(Callback):
    def __init__(self):
        self.steps = []

    def on_validation_end(self, trainer, pl_module):
        self.steps.append(trainer.global_step)


@pytest.mark.parametrize("preset", ["legacy_none", "default_d6"])
def test_a_validation_an_exception_interrupted_is_finished_on_resume(preset, tmp_path):
    """Lightning's loop finishes the validation the exception interrupted; the engine skipped it (the
    checkpoint had "restarted mid-evaluation" and "on the last batch" both set), so a ModelCheckpoint
    monitoring it never saved that step."""
    options = dict(val_check_interval=4, limit_val_batches=3, enable_checkpointing=True)
    FailsOneValidation.armed = True
    with pytest.raises(RuntimeError, match="validation failed"):
        fit(
            HSTUPipelineStrategy(preset),
            model_cls=FailsOneValidation,
            data_kwargs=dict(stateful=True),
            callbacks=[OnExceptionCheckpoint(tmp_path, "exc")],
            **options,
        )
    for engine in (False, True):  # Lightning's own loop, then the engine
        validated = ValidatedAt()
        fit(
            HSTUPipelineStrategy(preset, engine=engine),
            model_cls=FailsOneValidation,
            data_kwargs=dict(stateful=True),
            ckpt_path=tmp_path / "exc.ckpt",
            callbacks=[validated],
            **options,
        )
        assert validated.steps[0] == 8, engine


def test_a_mid_epoch_checkpoint_of_lightnings_loop_is_checked_on_resume(tmp_path):
    """Saved 5 batches of 8 into an epoch under ``engine=False``, resumed under the engine with batches of 4:
    refused, as a checkpoint of the engine's loop is (before, 5 batches of 4 were skipped where 5 of 8 were
    trained: 20 samples trained twice). A checkpoint of a loop that records nothing (Lightning's own
    strategy) resumes with a warning that it cannot be checked."""
    for strategy, name in ((HSTUPipelineStrategy("default_d6", engine=False), "ours"), ("auto", "lightning")):
        saver = ModelCheckpoint(dirpath=tmp_path / name, every_n_train_steps=5, filename="{step}")
        fit(strategy, data_kwargs=dict(shuffle=True), max_steps=5, enable_checkpointing=True, callbacks=[saver])
    with pytest.raises(CheckpointError, match="saved 5 batches into an epoch, with train dataloader batch size 8"):
        fit(
            HSTUPipelineStrategy("default_d6"),
            data_kwargs=dict(shuffle=True, batch_size=4),
            ckpt_path=tmp_path / "ours" / "step=5.ckpt",
            max_epochs=1,
        )
    with pytest.warns(UserWarning, match="by a loop that did not record its batch size and number of ranks"):
        fit(
            HSTUPipelineStrategy("default_d6"),
            data_kwargs=dict(shuffle=True),
            ckpt_path=tmp_path / "lightning" / "step=5.ckpt",
            max_epochs=1,
        )
