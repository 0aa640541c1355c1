"""Settings under faults: a step timeout that is validated and applies under every preset (a stalled data
loader included), strategy names and resumes that are refused with a message instead of running something
else than asked, and a ``lightning-hstu fit`` that leaves the user's own files alone."""

import re
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from conftest import engine_threads
from lightning_runs import QUIET, fit
from ranks import run_script
from tracing import TracingWorkload

from lightning_hstu import PRESET_NAMES, Engine, HSTUPipelineStrategy, PlanError, StepTimeout, get_plan
from lightning_hstu.data.toy import ToyDataModule
from lightning_hstu.engine import EngineError, LoaderTimeout
from lightning_hstu.loops import CheckpointError
from lightning_hstu.models.toy import ToyRecommender

STALL_S = 1.5  # how long a stalled body or loader blocks; far above the timeouts below, far below a hang
TIMEOUT_S = 0.5


# ----- step_timeout: validated where it is given --------------------------------------------------------


@pytest.mark.parametrize("bad", [0, -1, "abc", float("nan"), True])
def test_a_bad_step_timeout_is_refused_where_it_is_given(bad):
    valid = "a positive number of seconds, or None to wait forever"
    with pytest.raises(PlanError, match=f"step_timeout must be {valid}; got {bad!r}"):
        HSTUPipelineStrategy("default_d3", step_timeout=bad)
    plan = get_plan("default_d3")
    with pytest.raises(PlanError, match=f"step_timeout must be {valid}; got {bad!r}"):
        Engine(plan, TracingWorkload(plan).bodies(), step_timeout=bad)


@pytest.mark.parametrize("bad", [-5, float("nan"), float("inf"), 1e300, "10", True])
def test_a_bad_join_timeout_is_refused_where_it_is_given(bad):
    """Before, -5 and nan left the engine's threads running after close() (with a warning), and "10", inf and
    1e300 failed inside close(), after the whole run, a thread left running."""
    plan = get_plan("default_d3")
    with pytest.raises(
        EngineError, match=rf"join_timeout must be a number of seconds from 0 to .*; got {re.escape(repr(bad))}"
    ):
        Engine(plan, TracingWorkload(plan).bodies(), join_timeout=bad)


@pytest.mark.parametrize(("option", "meant"), [("step_timout", "step_timeout"), ("capture_graph", "capture_graphs")])
def test_a_misspelt_strategy_option_is_refused_naming_the_option_meant(option, meant):
    """Before, DDPStrategy kept the name for torch DDP, which is not built on one process or around a module
    that finalises its own gradients: the option was ignored (no step timeout, no graphs)."""
    with pytest.raises(TypeError, match=f"unexpected keyword argument '{option}'; did you mean '{meant}'"):
        HSTUPipelineStrategy("default_d6", **{option: 1.0})
    strategy = HSTUPipelineStrategy("default_d6", find_unused_parameters=True, process_group_backend="gloo")
    assert strategy._ddp_kwargs == {"find_unused_parameters": True}  # DDP's own options still pass through


# ----- step_timeout: applied under every preset, legacy_none included -----------------------------------


def _stalling_at(batch_index):
    def body(batch):
        if batch.index == batch_index:
            time.sleep(STALL_S)

    return body


@pytest.mark.usefixtures("no_thread_left")
@pytest.mark.parametrize("name", ["legacy_none", "default_d3"])
def test_a_hung_step_is_reported_under_every_preset(name):
    plan = get_plan(name)
    bodies = TracingWorkload(plan).bodies()
    bodies["forward"] = lambda batch, normal=bodies["forward"]: (_stalling_at(3)(batch), normal(batch))
    engine = Engine(plan, bodies, step_timeout=TIMEOUT_S).start()
    with pytest.raises(StepTimeout) as info:
        engine.run(range(8))
    thread = plan.task("forward").thread
    assert f"step 3 did not finish within {TIMEOUT_S:g} s" in str(info.value)
    assert f"thread '{thread}': running task 'forward' on batch 3" in str(info.value)
    assert "in body" in str(info.value)  # the stuck thread's Python stack
    assert engine_threads() == []


LIGHTNING_TIMEOUT_S = 3.0
"""Under Lightning a step does more (hooks, the first step's warm-up): a wider margin on a loaded machine."""


class HangsAtBatch3(ToyRecommender):
    def training_step(self, batch, batch_idx):
        if batch_idx == 3:
            time.sleep(3 * LIGHTNING_TIMEOUT_S)
        return super().training_step(batch, batch_idx)


@pytest.mark.usefixtures("no_thread_left")
def test_legacy_none_under_lightning_times_a_hung_training_step():
    with pytest.raises(StepTimeout) as info:
        fit(HSTUPipelineStrategy("legacy_none", step_timeout=LIGHTNING_TIMEOUT_S), model_cls=HangsAtBatch3)
    assert "thread 'main': running task 'forward' on batch 3" in str(info.value)
    assert "in training_step" in str(info.value)


# ----- a data loader that stalls ------------------------------------------------------------------------


@pytest.mark.usefixtures("no_thread_left")
@pytest.mark.parametrize("name", ["legacy_none", "full_split_d6"])
def test_a_stalled_loader_is_reported_with_its_name_and_stack(name):
    def batches_from_a_slow_disk():
        for index in range(10):
            if index == 6:
                time.sleep(STALL_S)
            yield index

    plan = get_plan(name)
    engine = Engine(plan, TracingWorkload(plan).bodies(), step_timeout=TIMEOUT_S).start()
    with pytest.raises(LoaderTimeout) as info:
        engine.run(batches_from_a_slow_disk())
    message = str(info.value)
    assert isinstance(info.value, StepTimeout)  # caught like any other timeout
    assert f"gave no batch within {TIMEOUT_S:g} s: batch 6, due for step {6 - plan.depth + 1}" in message
    assert "batches_from_a_slow_disk" in message  # the loader, named
    assert "time.sleep(STALL_S)" in message  # and where it is stuck
    assert engine_threads() == []


class SlowDataset(Dataset):
    def __init__(self, items, stall_at: int):
        self.items, self.stall_at = items, stall_at

    def __len__(self):
        return len(self.items)

    def __getitem__(self, index):
        if index == self.stall_at:
            time.sleep(STALL_S)
        return self.items[index]


class SlowDataModule(ToyDataModule):
    def train_dataloader(self):
        dataset = SlowDataset(torch.utils.data.TensorDataset(self.items, self.ratings), stall_at=40)
        return DataLoader(dataset, batch_size=self.hparams.batch_size)


@pytest.mark.usefixtures("no_thread_left")
def test_a_stalled_train_dataloader_is_reported_under_lightning():
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        strategy=HSTUPipelineStrategy("default_d6", step_timeout=TIMEOUT_S),
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        use_distributed_sampler=False,
        **QUIET,
    )
    with pytest.raises(LoaderTimeout) as info:
        trainer.fit(ToyRecommender(), SlowDataModule())
    message = str(info.value)
    assert "train dataloader (DataLoader of SlowDataset)" in message
    assert "in __getitem__" in message


# ----- names and resumes ---------------------------------------------------------------------------------


def test_an_unknown_hstu_strategy_name_is_a_plan_error_listing_the_presets():
    with pytest.raises(PlanError) as info:
        pl.Trainer(strategy="hstu_nope", accelerator="cpu", devices=1)
    assert "unknown strategy 'hstu_nope'; the HSTU strategies are: " in str(info.value)
    assert str(info.value).endswith(", ".join(f"hstu_{name}" for name in PRESET_NAMES))
    with pytest.raises(ValueError, match="invalid strategy name"):  # other names: Lightning's own error
        pl.Trainer(strategy="nope", accelerator="cpu", devices=1)


def test_a_process_group_left_without_a_cpu_backend_is_named_before_a_cpu_fit(tmp_path):
    """An earlier GPU run leaves its NCCL default group in the process (Lightning destroys it at exit only); a
    CPU fit after it is refused before anything runs, with what to do, not at its first collective."""
    result = run_script(Path(__file__).parent / "scripts" / "fit_after_a_cuda_group.py", tmp_path, timeout=300)
    assert result.returncode != 0
    assert "default process group already exists in this process" in result.stderr
    assert "with the backends 'cuda:gloo': none for cpu tensors" in result.stderr
    assert "Call torch.distributed.destroy_process_group() before this Trainer" in result.stderr
    assert "No backend type associated" not in result.stderr


def test_a_mid_epoch_resume_with_another_batch_size_is_refused(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1, filename="{step}")
    fit(
        HSTUPipelineStrategy("default_d6"),
        max_steps=3,
        callbacks=[checkpoint],
        enable_checkpointing=True,
        data_kwargs={"batch_size": 8},
    )
    with pytest.raises(CheckpointError) as info:
        fit(HSTUPipelineStrategy("default_d6"), ckpt_path=str(tmp_path / "step=3.ckpt"), data_kwargs={"batch_size": 16})
    message = str(info.value)
    assert "batch size 16" in message and "batch size 8" in message and "3 batches" in message
    # the same batch size resumes
    fit(HSTUPipelineStrategy("default_d6"), ckpt_path=str(tmp_path / "step=3.ckpt"), data_kwargs={"batch_size": 8})


# ----- the command line ----------------------------------------------------------------------------------

EXAMPLE = Path(__file__).parent.parent / "examples" / "toy.yaml"
QUIET_CLI = ["--trainer.max_epochs=1", "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]


def test_fit_leaves_the_users_own_config_yaml_alone(tmp_path, monkeypatch):
    from lightning_hstu.cli import run_lightning_cli

    monkeypatch.chdir(tmp_path)
    mine = "# my settings, with comments\nmodel:\n  class_path: my.Model\n"
    (tmp_path / "config.yaml").write_text(mine)
    with_a_logger = ["--trainer.logger=CSVLogger", "--trainer.logger.save_dir=."]
    for run, logger in enumerate([[], [], with_a_logger]):
        cli = run_lightning_cli(
            ["fit", "--config", str(EXAMPLE), "--trainer.strategy=hstu_default_d3", *logger, *QUIET_CLI]
        )
        assert cli.trainer.global_step == 16
        resolved = tmp_path / "lightning_logs" / f"version_{run}" / "config.yaml"
        assert "strategy: hstu_default_d3" in resolved.read_text()  # each run's resolved config, kept apart
    assert (tmp_path / "lightning_logs" / "version_2" / "metrics.csv").is_file()  # the logger's own directory
    assert (tmp_path / "config.yaml").read_text() == mine
