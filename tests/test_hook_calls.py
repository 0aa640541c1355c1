"""Lightning's per-batch hooks under the engine: each one that something overrides runs as under Lightning's loop
(as often, with the same ``_current_fx_name``, logging as there); those that nothing overrides are not dispatched;
with a profiler or Lightning's debug log every hook goes through Lightning's dispatchers."""

import contextlib
import logging
from collections import Counter

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.profilers import SimpleProfiler
from lightning.pytorch.trainer import call

from lightning_runs import fit

from lightning_hstu import HSTUPipelineStrategy
from lightning_hstu.loops import hook_calls
from lightning_hstu.loops.hook_calls import IDLE_BY_DEFAULT, skipping_idle_hooks
from lightning_hstu.models.toy import ToyRecommender

DISPATCHERS = ("_call_callback_hooks", "_call_lightning_module_hook", "_call_strategy_hook")
LIGHTNINGS = tuple(getattr(call, name) for name in DISPATCHERS)
BATCHES = 12  # ToyDataModule's training batches in one epoch


def _dispatchers():
    return tuple(getattr(call, name) for name in DISPATCHERS)


class Recorder(ToyRecommender):
    """Overrides the step's hooks, idle ones and working ones, and records each call with the module's
    ``_current_fx_name`` inside it; logs from two of them."""

    def __init__(self):
        super().__init__()
        self.calls = Counter()

    def _saw(self, hook):
        self.calls[(hook, self._current_fx_name)] += 1

    def training_step(self, batch, batch_idx):
        self._saw("training_step")
        return super().training_step(batch, batch_idx)

    def on_train_batch_start(self, batch, batch_idx):
        self._saw("on_train_batch_start")

    def on_before_zero_grad(self, optimizer):
        self._saw("on_before_zero_grad")

    def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
        self._saw("optimizer_zero_grad")
        super().optimizer_zero_grad(epoch, batch_idx, optimizer)

    def backward(self, loss, *args, **kwargs):
        self._saw("backward")
        super().backward(loss, *args, **kwargs)

    def on_after_backward(self):
        self._saw("on_after_backward")

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self._saw("configure_gradient_clipping")
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        self._saw("after optimizer_step's nested hooks")  # the name restored after configure_gradient_clipping

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self._saw("on_train_batch_end")
        self.log("batch_end", float(batch_idx))


class CallbackRecorder(Callback):
    """Overrides three per-batch hooks (one more set on the instance) and records the module's
    ``_current_fx_name`` in each."""

    def __init__(self):
        self.calls = Counter()
        self.on_before_zero_grad = lambda trainer, pl_module, optimizer: self._saw("on_before_zero_grad", pl_module)

    def _saw(self, hook, pl_module):
        self.calls[(hook, pl_module._current_fx_name)] += 1

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._saw("on_train_batch_start", pl_module)

    def on_before_backward(self, trainer, pl_module, loss):
        self._saw("on_before_backward", pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._saw("on_train_batch_end", pl_module)
        pl_module.log("callback_batch_end", float(batch_idx))


def _recorded(strategy, **kwargs):
    callback = CallbackRecorder()
    model, trainer = fit(strategy, model_cls=Recorder, callbacks=[callback], max_epochs=1, **kwargs)
    assert trainer.global_step == BATCHES
    return model.calls, callback.calls, sorted(trainer.callback_metrics)


@pytest.mark.parametrize("preset", ["legacy_none", "default_d6"])
def test_every_hook_something_overrides_runs_as_under_lightning_with_its_name_and_its_logging(preset):
    lightning = _recorded("auto")
    engine = _recorded(HSTUPipelineStrategy(preset))
    assert engine == lightning
    module_calls, callback_calls, metrics = engine
    assert module_calls == {
        (hook, hook): BATCHES
        for hook in (
            "training_step",
            "on_train_batch_start",
            "on_before_zero_grad",
            "optimizer_zero_grad",
            "backward",
            "on_after_backward",
            "configure_gradient_clipping",
            "on_train_batch_end",
        )
    } | {("after optimizer_step's nested hooks", "optimizer_step"): BATCHES}
    hooks = ("on_train_batch_start", "on_before_zero_grad", "on_before_backward", "on_train_batch_end")
    assert callback_calls == {(hook, hook): BATCHES for hook in hooks}
    assert {"batch_end", "callback_batch_end", "train_loss"} <= set(metrics)


@pytest.fixture
def idle_defaults(monkeypatch):
    """The defaults of the idle hooks on ``Callback`` and ``LightningModule``, replaced by do-nothing functions
    that count their calls (still the classes' defaults, so still idle)."""
    counts = Counter()
    for cls in (pl.Callback, pl.LightningModule):
        for hook in IDLE_BY_DEFAULT:

            def idle(*args, _key=(cls.__name__, hook), **kwargs):
                counts[_key] += 1

            monkeypatch.setattr(cls, hook, idle)
    return counts


def test_hooks_that_nothing_overrides_are_not_dispatched_under_the_engine(idle_defaults):
    fit("auto", max_epochs=1, callbacks=[CallbackRecorder()])
    assert idle_defaults[("LightningModule", "on_before_backward")] == BATCHES  # Lightning's loop calls them
    idle_defaults.clear()
    model, trainer = fit(HSTUPipelineStrategy("default_d6"), max_epochs=1, callbacks=[CallbackRecorder()])
    assert trainer.global_step == BATCHES
    assert not idle_defaults  # neither the module's nor the callback's (it overrides others only)


def test_with_a_profiler_every_hook_is_dispatched_and_reported_as_under_lightning():
    sections = {}
    for name, strategy in (("lightning", "auto"), ("engine", HSTUPipelineStrategy("default_d6"))):
        profiler = SimpleProfiler()
        fit(strategy, model_cls=Recorder, callbacks=[CallbackRecorder()], profiler=profiler, max_epochs=1)
        sections[name] = Counter()
        for key, durations in profiler.recorded_durations.items():
            owner, _, hook = key.partition("]")
            if owner in ("[Callback", "[LightningModule", "[Strategy") and "." in hook:
                hook = hook.rsplit(".", 1)[-1]
                if hook in IDLE_BY_DEFAULT or hook in ("training_step", "backward", "optimizer_step"):
                    sections[name][(owner, hook)] += len(durations)  # the strategy's class name differs
    assert sections["engine"] == sections["lightning"]
    assert sections["engine"][("[LightningModule", "on_before_backward")] == BATCHES  # idle here, still reported
    assert sections["engine"][("[Strategy", "training_step")] == BATCHES


def test_with_lightnings_debug_log_every_hook_call_is_logged_as_under_lightning(caplog):
    lines = {}
    for name, strategy in (("lightning", "auto"), ("engine", HSTUPipelineStrategy("legacy_none"))):
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger=call.log.name):
            fit(strategy, max_epochs=1)
        lines[name] = Counter(r.getMessage() for r in caplog.records if r.name == call.log.name)
    for line in (
        "Trainer: calling lightning module hook: on_before_backward",
        "Trainer: calling lightning module hook: optimizer_step",
        "Trainer: calling strategy hook: training_step",
        "Trainer: calling callback hook: on_train_batch_end",
    ):
        assert lines["engine"][line] == lines["lightning"][line] == BATCHES, line


class OwnSetattr(ToyRecommender):
    """A module whose class has its own ``__setattr__``: it sees every write of ``_current_fx_name``."""

    def __init__(self):
        super().__init__()
        self.names_set = Counter()

    def __setattr__(self, name, value):
        if name == "_current_fx_name" and "names_set" in self.__dict__:
            self.names_set[value] += 1
        super().__setattr__(name, value)


def test_a_module_with_its_own_setattr_sees_each_hook_name_written_as_under_lightning():
    written = {}
    for name, strategy in (("lightning", "auto"), ("engine", HSTUPipelineStrategy("legacy_none"))):
        model, _ = fit(strategy, model_cls=OwnSetattr, max_epochs=1)
        written[name] = model.names_set
    for hook in ("training_step", "optimizer_zero_grad", "configure_gradient_clipping"):
        assert written["engine"][hook] == written["lightning"][hook] == BATCHES, hook
    # written again each time a hook nested in them returns (the idle ones too, under Lightning's loop)
    for hook in ("backward", "optimizer_step"):
        assert written["lightning"][hook] > written["engine"][hook] >= BATCHES, hook


class Raises(ToyRecommender):
    def on_after_backward(self):
        raise ValueError("from the hook")


@pytest.mark.parametrize("dispatcher", ["module", "callback", "strategy"])
def test_a_hook_that_raises_leaves_the_module_as_lightnings_dispatcher_does(dispatcher):
    """The error passes through, and ``_current_fx_name`` keeps the failed hook's name, as Lightning's leaves it."""
    names = {}
    for dispatching in ("lightning", "engine"):
        trainer = pl.Trainer(logger=False, callbacks=[RaisingCallback()])
        module = Raises()
        trainer.strategy.connect(module)
        module.trainer = trainer
        module._current_fx_name = "training_step"
        with skipping_idle_hooks(trainer) if dispatching == "engine" else contextlib.nullcontext():
            with pytest.raises(ValueError, match="from the hook"):
                if dispatcher == "module":
                    call._call_lightning_module_hook(trainer, "on_after_backward")
                elif dispatcher == "callback":
                    call._call_callback_hooks(trainer, "on_after_backward")
                else:
                    trainer.strategy.on_train_batch_start = RaisingCallback.raising
                    call._call_strategy_hook(trainer, "on_train_batch_start", None, 0)
        names[dispatching] = module._current_fx_name
    assert names["engine"] == names["lightning"] != "training_step"


class RaisingCallback(Callback):
    @staticmethod
    def raising(*args):
        raise ValueError("from the hook")

    def on_after_backward(self, trainer, pl_module):
        self.raising()


def test_another_trainer_gets_lightnings_dispatchers_while_the_engine_runs(idle_defaults):
    with skipping_idle_hooks(pl.Trainer(logger=False)):  # another trainer's engine loop running meanwhile
        fit("auto", max_epochs=1)
    assert idle_defaults[("LightningModule", "on_before_backward")] == BATCHES


def test_lightnings_dispatchers_are_back_after_a_fit_and_after_a_failed_one():
    fit(HSTUPipelineStrategy("default_d6"), max_epochs=1)
    assert _dispatchers() == LIGHTNINGS

    class Fails(ToyRecommender):
        def training_step(self, batch, batch_idx):
            if batch_idx == 3:
                raise RuntimeError("boom")
            return super().training_step(batch, batch_idx)

    with pytest.raises(Exception, match="boom"):
        fit(HSTUPipelineStrategy("default_d6"), model_cls=Fails, max_epochs=1)
    assert _dispatchers() == LIGHTNINGS
    trainer = pl.Trainer(logger=False)
    with skipping_idle_hooks(trainer), skipping_idle_hooks(trainer):  # nested: one installation
        assert call._call_strategy_hook is hook_calls._strategy_hook
    assert _dispatchers() == LIGHTNINGS
