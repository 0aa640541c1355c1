"""Under every preset an ordinary LightningModule trains to bitwise the same weights, on the same batches
in the same order, as under Lightning's default strategy."""

import pytest
from lightning.pytorch.callbacks import Callback

from lightning_runs import assert_same_weights, fit

from lightning_hstu import PRESET_NAMES, HSTUPipelineStrategy
from lightning_hstu.data.toy import ToyDataModule

SCENARIOS = {
    "two_epochs": {},
    "limit_train_batches": {"limit_train_batches": 5},
    "max_steps_mid_epoch": {"max_steps": 7, "max_epochs": -1},  # 12 batches an epoch
    "accumulate_grad_batches": {"accumulate_grad_batches": 3, "limit_train_batches": 10},
}

_baselines = {}


def baseline(scenario):
    if scenario not in _baselines:
        _baselines[scenario] = fit("auto", **SCENARIOS[scenario])
    return _baselines[scenario]


@pytest.mark.usefixtures("no_thread_left")
@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_preset_trains_like_lightnings_default_loop(preset, scenario):
    expected_model, expected_trainer = baseline(scenario)
    model, trainer = fit(HSTUPipelineStrategy(preset), **SCENARIOS[scenario])
    assert model.batches_seen == expected_model.batches_seen
    assert trainer.global_step == expected_trainer.global_step
    assert trainer.current_epoch == expected_trainer.current_epoch
    assert_same_weights(model, expected_model)


def test_the_scenarios_really_cut_epochs_short():
    # guards the scenarios above: each must stop where it claims to
    assert len(baseline("limit_train_batches")[0].batches_seen) == 2 * 5
    assert baseline("max_steps_mid_epoch")[1].global_step == 7
    assert len(baseline("max_steps_mid_epoch")[0].batches_seen) == 7
    assert baseline("accumulate_grad_batches")[1].global_step == 2 * 4  # ceil(10 / 3) steps an epoch


class TrainedModules(Callback):
    def __init__(self):
        self.types = set()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.types.add(type(trainer.strategy.model).__name__)


def test_one_process_trains_the_module_itself_not_a_torch_ddp_wrapper():
    """On one process there is no gradient to average: the strategy leaves torch DDP (its reducer's work and
    a one-rank all-reduce in every backward) out, as Lightning's single-device strategy does; two ranks get
    it (test_strategy_ranks.py: the same weights as Lightning's DDP)."""
    seen = TrainedModules()
    fit(HSTUPipelineStrategy("default_d6"), callbacks=[seen], limit_train_batches=3, max_epochs=1)
    assert seen.types == {"ToyRecommender"}


@pytest.mark.usefixtures("no_thread_left")
@pytest.mark.parametrize("strategy", ["auto", "legacy_none", "default_d6"])
def test_a_second_fit_of_the_same_trainer_goes_on_where_the_first_stopped(strategy):
    """As Lightning's own loop: ``fit`` again after raising ``max_epochs`` trains the next epoch only (the
    epochs, batches and optimizer steps of the first fit stay counted), and ``fit`` again without raising it
    trains nothing."""
    model, trainer = fit("auto" if strategy == "auto" else HSTUPipelineStrategy(strategy), max_epochs=1)
    assert len(model.batches_seen) == 12
    trainer.fit_loop.max_epochs = 2
    trainer.fit(model, ToyDataModule())
    assert len(model.batches_seen) == 24 and trainer.current_epoch == 2 and trainer.global_step == 24
    trainer.fit(model, ToyDataModule())
    assert len(model.batches_seen) == 24 and trainer.global_step == 24
