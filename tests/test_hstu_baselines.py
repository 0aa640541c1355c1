"""The same HSTU step three ways on CPU: the engine, Lightning's own loop (``engine=False``, the baseline of
the benchmarks) and the fixed-length dense path that graph capture replays (``capture_graphs=True``; on CPU
nothing is captured, the padded path runs eagerly)."""

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_runs import fit
from test_hstu_model import fit_hstu

from lightning_hstu import Engine, EngineError, HSTUPipelineStrategy, get_plan
from lightning_hstu.hstu.graphs import GraphedMethod
from lightning_hstu.hstu.tasks import HSTU_TASK_NAMES

NO_BODIES = dict.fromkeys(HSTU_TASK_NAMES)
UNSHUFFLED = dict(balance_batches=False)  # Lightning's own loop has no shuffle task


def dense_weights(model):
    return {k: v.detach().clone() for k, v in model.objectives.state_dict().items()}


def assert_same_training(a, b, rtol=1e-5, atol=1e-6):
    (model_a, _, rec_a), (model_b, _, rec_b) = a, b
    assert len(rec_a.losses) == len(rec_b.losses) > 0
    torch.testing.assert_close(torch.tensor(rec_a.losses), torch.tensor(rec_b.losses), rtol=rtol, atol=atol)
    for (name, wa), wb in zip(dense_weights(model_a).items(), dense_weights(model_b).values()):
        torch.testing.assert_close(wa, wb, rtol=rtol, atol=atol, msg=name)
    for name, wa in model_a.embeddings.local_weights().items():
        torch.testing.assert_close(wa, model_b.embeddings.local_weights()[name], rtol=rtol, atol=atol, msg=name)


@pytest.fixture(scope="module")
def engine_run():
    return fit_hstu(
        epochs=2, limit_val_batches=0, strategy=HSTUPipelineStrategy("legacy_none"), model_kwargs=UNSHUFFLED
    )


@pytest.mark.usefixtures("no_thread_left")
def test_lightnings_own_loop_trains_the_same_steps_as_the_engine(engine_run):
    lightning_run = fit_hstu(
        epochs=2, limit_val_batches=0, strategy=HSTUPipelineStrategy(engine=False), model_kwargs=UNSHUFFLED
    )
    _, trainer, recorder = lightning_run
    assert recorder.records == []  # no engine step ran
    assert trainer.global_step == engine_run[1].global_step
    assert_same_training(lightning_run, engine_run)


# Sampled negatives here: with the full softmax every item row gets a gradient every step, and Adagrad's
# first steps (lr * g / |g|) turn the float noise of another summation order on rows of near-zero gradient
# into differences of 1e-4. The padded losses of both lengths are compared exactly in test_hstu_layers.
SAMPLED = dict(UNSHUFFLED, retrieval_loss="sampled")


@pytest.mark.usefixtures("no_thread_left")
@pytest.mark.parametrize("attention", ["padded", "grouped"])
def test_the_fixed_length_path_of_graph_capture_trains_like_the_batch_length_path(attention):
    """Graph capture's static shapes (padded: to the model's length; grouped: the jagged tokens grown to a
    token capacity), run eagerly on the CPU, train like the batch's own shapes."""
    kwargs = dict(SAMPLED, attention=attention)
    engine_run = fit_hstu(
        epochs=2, limit_val_batches=0, strategy=HSTUPipelineStrategy("legacy_none"), model_kwargs=kwargs
    )
    strategy = HSTUPipelineStrategy("legacy_none", capture_graphs=True)
    assert "forward@0[graph]" in strategy.plan.describe()
    padded_run = fit_hstu(epochs=2, limit_val_batches=0, strategy=strategy, model_kwargs=kwargs)
    graphed = padded_run[0].hstu_graphs()["forward"]
    assert graphed.eager_calls == len(padded_run[2].losses) and graphed.replays == 0  # CPU: never captured
    # Other padding, another summation order: the dense weights agree to 1e-7, but a table row updated by
    # many batches drifts further (2.3e-5 at most of 3152 elements, with the per-batch negatives of 2026-12-02)
    assert_same_training(padded_run, engine_run, rtol=1e-4, atol=5e-5)


def test_capture_graphs_needs_a_module_that_says_what_to_capture():
    with pytest.raises(MisconfigurationException, match="ToyRecommender defines no hstu_graphs"):
        fit(HSTUPipelineStrategy("default_d6", capture_graphs=True))
    with pytest.raises(ValueError, match="capture_graphs=True needs engine=True"):
        HSTUPipelineStrategy(capture_graphs=True, engine=False)


def test_graphs_for_a_task_the_plan_does_not_mark_capturable_are_refused():
    graphs = {"forward": GraphedMethod(torch.nn.Linear(2, 2), "forward")}
    with pytest.raises(
        EngineError,
        match=r"\['forward'\], which plan 'default_d6' does not mark capturable; "
        r"capturable tasks: none",
    ):
        Engine(get_plan("default_d6"), NO_BODIES, graphs=graphs)
    Engine(get_plan("default_d6", capturable=("forward", "backward")), NO_BODIES, graphs=graphs)  # accepted


def test_graph_capture_refuses_histories_longer_than_the_model_pads_to():
    with pytest.raises(
        ValueError,
        match=r"pads histories to the model's max_seq_len \(16\), but the data "
        r"module's histories reach max_seq_len=32",
    ):
        fit_hstu(
            epochs=1,
            strategy=HSTUPipelineStrategy("default_d6", capture_graphs=True),
            model_kwargs=dict(max_seq_len=16),
        )


@pytest.mark.usefixtures("no_thread_left")
def test_gradients_accumulated_over_batches_train_as_under_lightnings_own_loop():
    """``Trainer(accumulate_grad_batches=3)``: the dense gradients of a window's batches add up once each
    and the optimizer steps at the window's end, under the engine as under Lightning's own loop."""
    runs = [
        fit_hstu(
            epochs=1,
            limit_train_batches=7,
            limit_val_batches=0,
            accumulate_grad_batches=3,
            strategy=strategy,
            model_kwargs=SAMPLED,
        )
        for strategy in (HSTUPipelineStrategy("legacy_none"), HSTUPipelineStrategy(engine=False))
    ]
    assert runs[0][1].global_step == runs[1][1].global_step == 3  # ceil(7 / 3) optimizer steps
    assert_same_training(*runs)


class GradientsBeforeTheStep(Callback):
    """Whether every dense parameter has its gradient when the callbacks' on_before_optimizer_step runs."""

    def __init__(self):
        self.seen = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.seen.append(all(p.grad is not None for p in pl_module.objectives.parameters()))


@pytest.mark.usefixtures("no_thread_left")
@pytest.mark.parametrize("strategy", ["legacy_none", "lightning"])
def test_callbacks_see_the_reduced_gradients_before_the_optimizer_step(strategy):
    watch = GradientsBeforeTheStep()
    fit_hstu(
        epochs=1,
        limit_train_batches=3,
        limit_val_batches=0,
        callbacks=[watch],
        strategy=HSTUPipelineStrategy(engine=False) if strategy == "lightning" else HSTUPipelineStrategy(strategy),
        model_kwargs=SAMPLED,
    )
    assert watch.seen == [True, True, True]
