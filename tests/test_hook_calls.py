"""The per-batch hooks that nothing overrides are not dispatched under the engine; everything else is, as under
Lightning's loop."""

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

LIGHTNINGS = (call._call_callback_hooks, call._call_lightning_module_hook)


class AfterBackward(ToyRecommender):
    """Overrides one idle hook."""

    def __init__(self):
        super().__init__()
        self.after_backward = 0

    def on_after_backward(self):
        self.after_backward += 1


class BatchEnds(Callback):
    """Overrides one idle hook; another is set on an instance (``on_before_zero_grad``)."""

    def __init__(self):
        self.ends = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.ends += 1


@pytest.fixture
def dispatched(monkeypatch):
    """The hook names that reach Lightning's dispatchers, counted (callbacks' and the module's apart)."""
    counts = {"callbacks": Counter(), "module": Counter()}
    callbacks, module = hook_calls._lightning_callback_hooks, hook_calls._lightning_module_hook

    def count_callbacks(trainer, hook_name, *args, **kwargs):
        counts["callbacks"][hook_name] += 1
        return callbacks(trainer, hook_name, *args, **kwargs)

    def count_module(trainer, hook_name, *args, **kwargs):
        counts["module"][hook_name] += 1
        return module(trainer, hook_name, *args, **kwargs)

    monkeypatch.setattr(hook_calls, "_lightning_callback_hooks", count_callbacks)
    monkeypatch.setattr(hook_calls, "_lightning_module_hook", count_module)
    monkeypatch.setattr(call, "_call_callback_hooks", count_callbacks)  # Lightning's loop, outside the engine
    monkeypatch.setattr(call, "_call_lightning_module_hook", count_module)
    return counts


def _fit(strategy, zero_grads):
    ends = BatchEnds()
    ends.on_before_zero_grad = lambda trainer, pl_module, optimizer: zero_grads.append(trainer.global_step)
    model, trainer = fit(strategy, model_cls=AfterBackward, callbacks=[ends], max_epochs=1)
    return model, trainer, ends


@pytest.mark.parametrize("preset", ["legacy_none", "default_d6"])
def test_only_hooks_that_something_overrides_are_dispatched_and_they_run_as_under_lightning(preset, dispatched):
    runs = {}
    for name, strategy in (("lightning", "auto"), ("engine", HSTUPipelineStrategy(preset))):
        for counter in dispatched.values():
            counter.clear()
        zero_grads = []
        model, trainer, ends = _fit(strategy, zero_grads)
        runs[name] = (model.after_backward, ends.ends, zero_grads, trainer.global_step)
        idle = {kind: {h: n for h, n in counts.items() if h in IDLE_BY_DEFAULT} for kind, counts in dispatched.items()}
        runs[name + " dispatched"] = idle
    assert runs["engine"] == runs["lightning"]
    batches = runs["engine"][3]
    assert batches == 12 and runs["engine"][:2] == (batches, batches)
    assert runs["lightning dispatched"]["module"] == {hook: batches for hook in IDLE_BY_DEFAULT}
    # the callbacks: on_train_batch_end (a class override) and on_before_zero_grad (an instance's) only
    assert runs["engine dispatched"]["callbacks"] == {"on_train_batch_end": batches, "on_before_zero_grad": batches}
    assert runs["engine dispatched"]["module"] == {"on_after_backward": batches}


def test_with_a_profiler_every_hook_is_dispatched_and_reported_as_under_lightning():
    sections = {}
    for name, strategy in (("lightning", "auto"), ("engine", HSTUPipelineStrategy("default_d6"))):
        profiler = SimpleProfiler()
        fit(strategy, model_cls=AfterBackward, callbacks=[BatchEnds()], profiler=profiler, max_epochs=1)
        sections[name] = {
            key: len(durations)
            for key, durations in profiler.recorded_durations.items()
            if key.startswith(("[Callback]", "[LightningModule]")) and key.rsplit(".", 1)[-1] in IDLE_BY_DEFAULT
        }
    assert sections["engine"] == sections["lightning"]
    assert len(sections["engine"]) == 2 * len(IDLE_BY_DEFAULT)  # BatchEnds' and the module's, each hook


def test_another_trainer_gets_every_call_while_the_engine_skips(dispatched):
    with skipping_idle_hooks(pl.Trainer(logger=False)):  # another trainer's engine loop running meanwhile
        fit("auto", model_cls=AfterBackward, callbacks=[BatchEnds()], max_epochs=1)
    assert dispatched["module"]["on_before_backward"] == dispatched["callbacks"]["on_before_backward"] == 12


def test_lightnings_dispatchers_are_back_after_a_fit_and_after_a_failed_one():
    fit(HSTUPipelineStrategy("default_d6"), max_epochs=1)
    assert (call._call_callback_hooks, call._call_lightning_module_hook) == LIGHTNINGS

    class Fails(ToyRecommender):
        def training_step(self, batch, batch_idx):
            if batch_idx == 3:
                raise RuntimeError("boom")
            return super().training_step(batch, batch_idx)

    with pytest.raises(Exception, match="boom"):
        fit(HSTUPipelineStrategy("default_d6"), model_cls=Fails, max_epochs=1)
    assert (call._call_callback_hooks, call._call_lightning_module_hook) == LIGHTNINGS
    trainer = pl.Trainer(logger=False)
    with skipping_idle_hooks(trainer), skipping_idle_hooks(trainer):  # nested: one installation
        assert call._call_callback_hooks is hook_calls._callback_hooks
    assert (call._call_callback_hooks, call._call_lightning_module_hook) == LIGHTNINGS
