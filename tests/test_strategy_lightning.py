"""What Lightning users rely on keeps working under the strategy: hooks with the right batch and index,
self.log and loggers, validation, checkpoints, early stopping, clipping, bf16 autocast, LR schedulers;
clear errors; engine threads joined."""

import signal
import threading

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, EarlyStopping, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.profilers import SimpleProfiler
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn
from torch.utils.data import DataLoader, TensorDataset, default_collate

from conftest import engine_threads
from lightning_runs import QUIET, assert_same_weights, fit

from lightning_hstu import HSTUPipelineStrategy, PlanError, TaskError
from lightning_hstu.data.toy import ToyDataModule
from lightning_hstu.models.toy import ToyRecommender


class HookRecorder(Callback):
    """Records what callbacks are told, and on which thread."""

    def __init__(self):
        self.events = []
        self.threads = set()
        self.autocast_in_training_step = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.events.append(("start", batch_idx, int(batch[0].sum())))
        self.threads.add(threading.current_thread().name)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.events.append(("end", batch_idx, int(batch[0].sum()), float(outputs["loss"]), trainer.global_step))
        self.threads.add(threading.current_thread().name)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.events.append(
            (
                "before_optimizer_step",
                trainer.global_step,
                float(sum(p.grad.norm() ** 2 for p in pl_module.parameters())) ** 0.5,
            )
        )

    def on_validation_end(self, trainer, pl_module):
        self.events.append(("validation", trainer.global_step, float(trainer.callback_metrics["val_loss"])))


class AutocastProbe(ToyRecommender):
    def training_step(self, batch, batch_idx):
        self.autocast_seen = torch.is_autocast_enabled("cpu")
        return super().training_step(batch, batch_idx)


FEATURES = dict(
    gradient_clip_val=0.05, precision="bf16-mixed", val_check_interval=0.5, max_epochs=3, log_every_n_steps=2
)


def run_with_features(strategy, tmp_path):
    recorder = HookRecorder()
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1)
    stopper = EarlyStopping(monitor="val_loss", patience=1, min_delta=0.02)
    logger = CSVLogger(tmp_path, name="logs", version=0)
    model, trainer = fit(
        strategy,
        model_cls=AutocastProbe,
        model_kwargs={"lr_step_size": 5},
        logger=logger,
        enable_checkpointing=True,
        callbacks=[recorder, checkpoints, stopper],
        **FEATURES,
    )
    metrics = (tmp_path / "logs" / "version_0" / "metrics.csv").read_text()
    saved = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    return model, trainer, recorder, metrics, saved


@pytest.mark.usefixtures("no_thread_left")
@pytest.mark.parametrize("preset", ["legacy_none", "per_task_d3", "default_d6"])
def test_hooks_logging_validation_checkpoints_and_early_stopping_match_lightning(preset, tmp_path):
    expected = run_with_features("auto", tmp_path / "auto")
    got = run_with_features(HSTUPipelineStrategy(preset), tmp_path / preset)
    model, trainer, recorder, metrics, saved = got
    e_model, e_trainer, e_recorder, e_metrics, e_saved = expected
    assert recorder.events == e_recorder.events  # batches, indices, losses, grad norms after clipping
    assert recorder.threads == {threading.main_thread().name}  # batch hooks run on the caller's thread
    assert metrics == e_metrics  # what self.log sent to the logger, step by step
    assert saved == e_saved  # every_n_train_steps checkpoints, same names (epoch and step)
    assert (trainer.current_epoch, trainer.global_step) == (e_trainer.current_epoch, e_trainer.global_step)
    assert trainer.current_epoch < FEATURES["max_epochs"]  # early stopping did stop it
    assert model.autocast_seen  # bf16 autocast entered on the worker thread that ran training_step
    scheduler, e_scheduler = trainer.lr_scheduler_configs[0].scheduler, e_trainer.lr_scheduler_configs[0].scheduler
    assert scheduler.last_epoch == e_scheduler.last_epoch
    assert_same_weights(model, e_model)


class BatchEnds(Callback):
    """Records (epoch, batch index, batch given, outputs given, global step) at every ``on_train_batch_end``."""

    def __init__(self):
        self.ends = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        given = (batch is not None, outputs is not None)
        self.ends.append((trainer.current_epoch, batch_idx, *given, trainer.global_step))


class SomeBatchesNone(ToyDataModule):
    """A collate function that drops every batch whose items sum to a multiple of 3 (it gives None)."""

    def train_dataloader(self):
        def collate(samples):
            batch = default_collate(samples)
            return None if int(batch[0].sum()) % 3 == 0 else batch

        return DataLoader(TensorDataset(self.items, self.ratings), batch_size=8, collate_fn=collate)


@pytest.mark.usefixtures("no_thread_left")
@pytest.mark.parametrize("preset", ["legacy_none", "default_d6"])
def test_a_batch_the_loader_gives_as_none_ends_with_the_hooks_as_under_lightning(preset):
    """Lightning trains nothing on a None batch and still calls ``on_train_batch_end`` for it (outputs and
    batch None): a callback that counts batches, or stops training at one, runs there too."""
    runs = {}
    for name, strategy in (("lightning", HSTUPipelineStrategy(engine=False)), (preset, HSTUPipelineStrategy(preset))):
        ends = BatchEnds()
        pl.seed_everything(0, verbose=False)
        model = ToyRecommender()
        trainer = pl.Trainer(strategy=strategy, callbacks=[ends], accelerator="cpu", devices=1, max_epochs=2, **QUIET)
        trainer.fit(model, SomeBatchesNone())
        runs[name] = ends.ends, model
    (ends, model), (expected, e_model) = runs[preset], runs["lightning"]
    assert any(not given for _, _, given, _, _ in expected)  # the data did give None batches
    assert ends == expected
    assert_same_weights(model, e_model)


class LogsNowAndThen(ToyRecommender):
    """Also logs a value on the progress bar at batches 1 and 5 only (1000 + the batch index)."""

    def training_step(self, batch, batch_idx):
        if batch_idx in (1, 5):
            self.log("now_and_then", torch.tensor(1000.0 + batch_idx), prog_bar=True)
        return super().training_step(batch, batch_idx)


@pytest.mark.usefixtures("no_thread_left")
def test_a_value_logged_now_and_then_is_turned_into_a_number_per_log_not_per_step(tmp_path, monkeypatch):
    """Lightning turns every value shown on the progress bar into a number at every batch end, also one
    logged steps ago: on a GPU a copy to the host that waits for the device, each step. Under the engine a
    value logged for steps only is converted until the loggers have had it (log_every_n_steps=3: batches
    2, 5 and 8 write), then no more; the progress bar, callback_metrics and the logger still get it."""
    from lightning.pytorch.trainer.connectors.logger_connector import result

    converted = []

    def convert(value):
        number = convert_tensors_to_scalars(value)
        if number >= 1000:
            converted.append(number)
        return number

    convert_tensors_to_scalars = result.convert_tensors_to_scalars
    monkeypatch.setattr(result, "convert_tensors_to_scalars", convert)
    logger = CSVLogger(tmp_path, name="logs", version=0)
    _, trainer = fit(
        HSTUPipelineStrategy("default_d6"), model_cls=LogsNowAndThen, max_steps=9, log_every_n_steps=3, logger=logger
    )
    # batch 1's end; batch 2's, twice (the batch end, then the write); batch 5's, twice; none after
    assert converted == [1001.0] * 3 + [1005.0] * 2
    assert trainer.progress_bar_metrics["now_and_then"] == 1005.0
    assert float(trainer.callback_metrics["now_and_then"]) == 1005.0
    rows = (tmp_path / "logs" / "version_0" / "metrics.csv").read_text().splitlines()
    column = rows[0].split(",").index("now_and_then")
    step = rows[0].split(",").index("step")
    written = [(int(r.split(",")[step]), float(r.split(",")[column])) for r in rows[1:] if r.split(",")[column]]
    assert written == [(2, 1001.0), (5, 1005.0)]

    converted.clear()
    fit("auto", model_cls=LogsNowAndThen, max_steps=9, log_every_n_steps=3)
    assert len(converted) == 8 + 3  # Lightning's own loop: every batch end from batch 1 on, and the 3 writes


def test_every_preset_is_registered_by_name():
    trainer = pl.Trainer(strategy="hstu_full_split_d6", accelerator="cpu", devices=1, logger=False)
    assert isinstance(trainer.strategy, HSTUPipelineStrategy)
    assert trainer.strategy.plan.name == "full_split_d6"


def test_bad_configuration_fails_when_the_strategy_is_made():
    with pytest.raises(PlanError, match="unknown preset 'default_d7'; valid presets: legacy_none"):
        HSTUPipelineStrategy("default_d7")
    with pytest.raises(PlanError, match="thread_map misses task 'watchdog'"):
        HSTUPipelineStrategy("default_d3", thread_map={t: "one" for t in ToyThreadMap.ALL if t != "watchdog"})
    with pytest.raises(PlanError, match="consumer 'start_input_dist' .* producer 'finish_shuffle'"):
        HSTUPipelineStrategy(
            "default_d6", lookahead={"h2d": 2, "start_shuffle": 2, "finish_shuffle": 1, "start_input_dist": 2}
        )
    with pytest.raises(PlanError, match="finish_shuffle at lookahead >= 1"):
        HSTUPipelineStrategy("default_d3", lookahead={})


class ToyThreadMap:
    from lightning_hstu.hstu.tasks import HSTU_TASK_NAMES as ALL


def test_a_custom_thread_map_and_lookahead_train_like_the_default(tmp_path):
    thread_map = {
        t: ("loader" if t in ("h2d", "start_shuffle", "finish_shuffle") else "trainer") for t in ToyThreadMap.ALL
    }
    lookahead = {"h2d": 4, "start_shuffle": 3, "finish_shuffle": 3, "start_input_dist": 1, "wait_input_dist": 1}
    model, _ = fit(HSTUPipelineStrategy("default_d3", thread_map=thread_map, lookahead=lookahead))
    expected, _ = fit("auto")
    assert_same_weights(model, expected)


class ManualModule(ToyRecommender):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False


@pytest.mark.usefixtures("no_thread_left")
def test_manual_optimization_is_refused_at_start():
    with pytest.raises(MisconfigurationException, match="supports automatic optimization only"):
        fit(HSTUPipelineStrategy("default_d3"), model_cls=ManualModule)


class FailsAtBatch7(ToyRecommender):
    def training_step(self, batch, batch_idx):
        if batch_idx == 7:
            raise ValueError("exploding loss")
        return super().training_step(batch, batch_idx)


@pytest.mark.usefixtures("no_thread_left")
@pytest.mark.parametrize("preset", ["legacy_none", "default_d6", "per_task_d3"])
def test_an_error_in_training_step_names_task_batch_and_thread(preset):
    strategy = HSTUPipelineStrategy(preset)
    with pytest.raises(TaskError) as info:
        fit(strategy, model_cls=FailsAtBatch7)
    thread = strategy.plan.task("forward").thread
    assert (info.value.task, info.value.batch, info.value.thread) == ("forward", 7, thread)
    assert "task 'forward' failed on batch 7" in str(info.value) and "exploding loss" in str(info.value)
    assert isinstance(info.value.__cause__, ValueError)
    assert engine_threads() == []


class InterruptAtBatch3(Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == 3:
            raise KeyboardInterrupt


def test_an_interrupt_tears_the_engine_down():
    handler = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(SystemExit):  # Lightning's graceful shutdown exits after its teardown
            fit(HSTUPipelineStrategy("full_split_d6"), callbacks=[InterruptAtBatch3()])
    finally:
        signal.signal(signal.SIGINT, handler)  # Lightning ignores SIGINT from then on
    assert engine_threads() == []


class RecordsCollector(Callback):
    def __init__(self):
        self.records = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.records.extend(trainer.strategy.step_records)


def test_task_records_show_what_a_plain_module_skips():
    collector = RecordsCollector()
    fit(HSTUPipelineStrategy("full_split_d6"), callbacks=[collector], max_epochs=1)
    runs = {}
    for record in collector.records:
        runs.setdefault(record.task, []).append(record)
    assert {task: len(r) for task, r in runs.items()} == {task: 12 for task in ToyThreadMap.ALL}
    skipped = {task for task, r in runs.items() if all(x.skipped for x in r)}
    assert skipped == {
        "start_shuffle",
        "finish_shuffle",
        "start_input_dist",
        "wait_input_dist",
        "prefetch_embeddings",
        "global_tokens_allreduce",
        "compute_output_dist",
        "finalize_model_grads",
        "watchdog",
    }
    assert sorted(r.batch for r in runs["forward"]) == list(range(12))


class TokenNormalised(ToyRecommender):
    """Implements two HSTU hooks: a global token count the loss is normalised by, and a watchdog."""

    def hstu_global_tokens_allreduce(self, batch):
        items, _ = batch["shuffled_batch"]
        batch["global_tokens"] = torch.tensor(float(items.numel()))

    def hstu_watchdog(self, batch):
        self.watched = getattr(self, "watched", 0) + 1
        if not torch.isfinite(batch["loss"].loss):
            raise FloatingPointError(f"non-finite loss at batch {batch.index}")

    def training_step(self, batch, batch_idx):
        items, ratings = batch
        tokens = self.trainer.strategy.step_context.slots["global_tokens"]
        return nn.functional.mse_loss(self(items), ratings, reduction="sum") * ratings.numel() / tokens


class InlineNormalised(ToyRecommender):
    def training_step(self, batch, batch_idx):
        items, ratings = batch
        return nn.functional.mse_loss(self(items), ratings, reduction="sum") * ratings.numel() / items.numel()


@pytest.mark.usefixtures("no_thread_left")
def test_a_module_implementing_hstu_hooks_gets_them_run_as_tasks():
    collector = RecordsCollector()
    model, _ = fit(HSTUPipelineStrategy("per_task_d3"), model_cls=TokenNormalised, callbacks=[collector])
    expected, _ = fit("auto", model_cls=InlineNormalised)
    assert_same_weights(model, expected)
    assert model.watched == 24
    ran = {r.task for r in collector.records if not r.skipped}
    assert {"global_tokens_allreduce", "watchdog"} <= ran
    assert "start_shuffle" not in ran


@pytest.mark.parametrize("preset", ["legacy_none", "default_d6"])
def test_lightnings_profiler_times_each_training_batch_as_under_its_own_loop(preset):
    """Lightning's "run_training_batch" section, once per trained batch (what SimpleProfiler and
    AdvancedProfiler report), under the engine as under Lightning's own loop."""
    counts = {}
    for name, strategy in (("engine", HSTUPipelineStrategy(preset)), ("lightning", "auto")):
        profiler = SimpleProfiler()
        _, trainer = fit(strategy, profiler=profiler)
        counts[name] = (len(profiler.recorded_durations["run_training_batch"]), trainer.global_step)
    assert counts["engine"] == counts["lightning"]
    assert counts["engine"][0] == counts["engine"][1] > 0


class CountedTransfer(HSTUPipelineStrategy):
    """A strategy whose batch transfer a user changed: it must move every training batch."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.threads = []

    def batch_to_device(self, batch, device=None, dataloader_idx=0):
        self.threads.append(threading.current_thread().name)
        return super().batch_to_device(batch, device, dataloader_idx)


class CountsTransferHooks(ToyRecommender):
    after_transfer = 0

    def on_after_batch_transfer(self, batch, dataloader_idx):
        self.after_transfer += 1
        return batch


@pytest.mark.parametrize("preset", ["legacy_none", "default_d6"])
def test_the_strategys_batch_to_device_moves_every_training_batch_through_the_modules_hooks(preset):
    strategy = CountedTransfer(preset)
    model, trainer = fit(strategy, model_cls=CountsTransferHooks, limit_val_batches=0)
    assert len(strategy.threads) == model.after_transfer == trainer.global_step == 24  # 2 epochs of 12
    io = strategy.plan.task("h2d").thread
    assert set(strategy.threads) == {f"hstu-{io}"}  # on the thread the plan gives h2d


class BatchOnlyStep(ToyRecommender):
    """A ``training_step`` without ``batch_idx`` (Lightning allows it), which a callback swaps for one with it
    after four batches."""

    def training_step(self, batch):
        return super().training_step(batch, None)


class SwapTrainingStep(Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 4:
            pl_module.training_step = ToyRecommender.training_step.__get__(pl_module)


@pytest.mark.parametrize("strategy", [HSTUPipelineStrategy("default_d6"), "auto"])
def test_training_step_gets_batch_idx_exactly_when_it_takes_one(strategy):
    model, _ = fit(strategy, model_cls=BatchOnlyStep, max_epochs=1, callbacks=[SwapTrainingStep()])
    assert [index for index, _ in model.batches_seen] == [None] * 4 + list(range(4, 12))
