"""The HSTU workload on one CUDA device (NCCL, TorchRec's fused GPU kernels, megatron-core): under every
preset the weights after some steps equal legacy_none's, also with random delays injected into the tasks
on the host and on their GPU streams. The delays make the test sensitive: with the engine's cross-stream
event waits switched off, the delayed runs differ (checked on the H200, 2026-11-29). Skipped without
CUDA; run on the GPU machine with TorchRec's GPU build (see the README)."""

import json
from collections import Counter

import lightning.pytorch as pl
import pytest
import torch
from delayed_hstu import DelayedTasks
from lightning.pytorch.callbacks import Callback

from lightning_runs import QUIET
from small_hstu import GPU_MODEL, gpu_data

from lightning_hstu import PRESET_NAMES, HSTUPipelineStrategy
from lightning_hstu.callbacks import CollectiveInventoryCallback, TraceCallback
from lightning_hstu.callbacks.collectives import format_inventory
from lightning_hstu.hstu.graphs import GraphedMethod, token_capacity
from lightning_hstu.models.hstu import HSTURecommender
from lightning_hstu.models.hstu_layers import _compiled_token_wise
from lightning_hstu.plan import EdgeKind

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

STEPS = 8


class PrefetchCount(Callback):
    def __init__(self):
        self.ran = self.skipped = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        for r in trainer.strategy.step_records:
            if r.task == "prefetch_embeddings":
                self.ran += not r.skipped
                self.skipped += r.skipped


def train(
    preset,
    model_cls=HSTURecommender,
    seed=0,
    callbacks=(),
    capture_graphs=False,
    engine=True,
    steps=STEPS,
    **model_kwargs,
):
    pl.seed_everything(0, verbose=False)
    torch.use_deterministic_algorithms(False)
    model = model_cls(**{**GPU_MODEL, **model_kwargs})
    model.delay_seed = seed
    trainer = pl.Trainer(
        strategy=HSTUPipelineStrategy(preset, capture_graphs=capture_graphs, engine=engine),
        accelerator="cuda",
        devices=1,
        max_steps=steps,
        **QUIET,
        limit_val_batches=0,
        callbacks=list(callbacks),
    )
    trainer.fit(model, gpu_data())
    dense = {k: v.detach().cpu() for k, v in model.objectives.state_dict().items()}
    sparse = {k: v.detach().cpu() for k, v in model.embeddings.local_weights().items()}
    return dense, sparse


@pytest.fixture(scope="module")
def legacy():
    return train("legacy_none")


def assert_close_weights(got, expected):
    for part_got, part_expected in zip(got, expected):
        assert part_got.keys() == part_expected.keys()
        for name, value in part_expected.items():
            # same kernels and order; atomics in the embedding backward allow float noise only
            torch.testing.assert_close(part_got[name], value, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("preset", PRESET_NAMES[1:])
def test_every_preset_trains_the_hstu_stack_like_legacy(preset, legacy):
    assert_close_weights(train(preset), legacy)


def test_lightnings_own_loop_trains_like_legacy(legacy):
    assert_close_weights(train("legacy_none", engine=False), legacy)  # one rank: the shuffler is the identity


@pytest.mark.parametrize("seed", [1, 2])
def test_random_host_delays_change_nothing(seed, legacy):
    assert_close_weights(train("per_task_d3", DelayedTasks, seed), legacy)
    assert_close_weights(train("full_split_d6", DelayedTasks, seed), legacy)


@pytest.mark.parametrize("preset", ["by_stream_d3", "full_split_d6"])
def test_cached_tables_are_prefetched_and_train_like_uncached_ones(preset, legacy):
    """A cache of a fifth of each table (rows move between GPU and host memory every step): the prefetch
    task does its job, one batch or more ahead of the lookup, and the weights equal the uncached run's."""
    count = PrefetchCount()
    assert_close_weights(train(preset, callbacks=[count], cache_load_factor=0.2), legacy)
    plan = HSTUPipelineStrategy(preset).plan
    assert count.skipped == 0 and count.ran == STEPS + plan.task("prefetch_embeddings").lookahead


def test_a_lookup_outside_the_engine_while_batches_are_prefetched_is_refused():
    model = HSTURecommender(**GPU_MODEL, cache_load_factor=0.2)
    with pytest.raises(RuntimeError, match="prefetched training batch"):
        pl.seed_everything(0, verbose=False)
        trainer = pl.Trainer(
            strategy=HSTUPipelineStrategy("default_d6"),
            accelerator="cuda",
            devices=1,
            max_steps=STEPS,
            val_check_interval=3,
            limit_val_batches=1,
            **QUIET,
        )
        trainer.fit(model, gpu_data())


class NeverCaptured(HSTURecommender):
    """The static-shape dense path of graph capture, always eager: what the graphs must reproduce."""

    def hstu_graphs(self):
        if self._graphed is None:
            self._graphed = GraphedMethod(self.objectives, "losses", warmup=10**9)
        return {"forward": self._graphed}


class GraphUse(Callback):
    def on_train_end(self, trainer, pl_module):
        graphed = pl_module.hstu_graphs()["forward"]
        self.replays, self.eager_calls, self.graphs = graphed.replays, graphed.eager_calls, len(graphed.graphs)
        self.capacities = getattr(graphed, "capacities", None)
        optimizer = trainer.optimizers[0]
        self.optimizer_steps = (optimizer.eager_steps, optimizer.replays)  # a GraphedAdamW
        self.fused = optimizer.defaults["fused"]  # dense_adamw's on CUDA


@pytest.fixture(scope="module")
def padded_eager():
    use = GraphUse()
    weights = train("default_d6", NeverCaptured, callbacks=[use], capture_graphs=True, attention="padded")
    assert (use.replays, use.graphs, use.optimizer_steps) == (0, 0, (STEPS, 0))
    return weights


@pytest.mark.parametrize("preset", ["legacy_none", "default_d6", "full_split_d6"])
def test_the_graph_captured_dense_part_trains_like_its_eager_self(preset, padded_eager):
    """Padded attention: one shape, captured after 3 eager steps (between two steps, by the engine),
    replayed for the other 5: the dense forward and backward from the graphs, the embeddings eager and fed
    the graph's input gradient; the AdamW step captured after its 3 eager steps too, against a run whose
    every step is eager."""
    use = GraphUse()
    assert_close_weights(train(preset, callbacks=[use], capture_graphs=True, attention="padded"), padded_eager)
    assert (use.eager_calls, use.replays, use.graphs) == (3, STEPS - 3, 1)
    assert use.optimizer_steps == (3, STEPS - 3)
    assert use.fused


def test_a_cosine_learning_rate_reaches_the_captured_optimizer_step():
    """``lr_schedule="cosine"`` with the AdamW step replayed from a graph: each step's rate reaches the replays
    (the weights equal those of the run whose every step is eager, under the same schedule)."""
    eager = train("default_d6", NeverCaptured, capture_graphs=True, attention="padded", lr_schedule="cosine")
    use = GraphUse()
    graphed = train("default_d6", callbacks=[use], capture_graphs=True, attention="padded", lr_schedule="cosine")
    assert use.optimizer_steps == (3, STEPS - 3)
    assert_close_weights(graphed, eager)


def test_random_host_delays_change_nothing_with_graphs(padded_eager):
    class DelayedAndGraphed(DelayedTasks):
        pass

    assert_close_weights(
        train("full_split_d6", DelayedAndGraphed, seed=3, capture_graphs=True, attention="padded"), padded_eager
    )


class CapacityLog(GraphedMethod):
    """Records the token capacity (the rows the events are grown to) of every call."""

    def __call__(self, *args, rows=None, grown=()):
        self.capacities.append(rows)
        return super().__call__(*args, rows=rows, grown=grown)


def coarser_capacities(objectives):
    """``objectives.graph_growth`` with its token capacities rounded up to four per power of two."""
    growth = objectives.graph_growth

    def grown(inputs):
        rows, tensors = growth(inputs)
        if rows is None:
            return rows, tensors
        return token_capacity(rows, objectives.max_events * len(inputs.lengths), per_power_of_two=4), tensors

    return grown


class FusedGraphs(HSTURecommender):
    """Fused attention, each token capacity captured after its first (eager) call. The capacities are the
    model's rounded up to four per power of two: with thirty-two the test's eight batches (about 110-250 events)
    each have a capacity of their own, and none would be replayed."""

    warmup = 1

    def hstu_graphs(self):
        if self._graphed is None:
            self.objectives.graph_growth = coarser_capacities(self.objectives)
            self._graphed = CapacityLog(self.objectives, "losses", warmup=self.warmup, max_graphs=STEPS)
            self._graphed.capacities = []
        return {"forward": self._graphed}


@pytest.mark.parametrize(
    "preset, compile_layers, history_logit",
    [("legacy_none", False, False), ("full_split_d6", False, False), ("legacy_none", True, False)]
    + [("legacy_none", False, True)],
)
def test_the_fused_dense_part_is_captured_per_token_capacity_and_trains_like_its_eager_self(
    preset, compile_layers, history_logit
):
    """Jagged inputs grown to a capacity (a few per power of two): one graph per capacity seen; a batch whose
    capacity was captured replays it; the weights equal the eager run's (also with the history logit, whose
    table of the histories' items the graphs build from the grown target ids)."""

    class FusedEager(FusedGraphs):
        warmup = 10**9

    eager_use, use = GraphUse(), GraphUse()
    options = dict(capture_graphs=True, attention="fused", compile_layers=compile_layers, history_logit=history_logit)
    eager = train(preset, FusedEager, callbacks=[eager_use], **options)
    graphed = train(preset, FusedGraphs, callbacks=[use], **options)
    assert_close_weights(graphed, eager)
    capacities = use.capacities
    assert len(capacities) == STEPS
    assert all(token_capacity(c, 64 * 16) == c for c in capacities), capacities  # capacities of the model's
    # the first call of a capacity runs eagerly; it is captured between that step and the next, so a
    # capacity first seen at the last step is never captured
    distinct, captured = len(set(capacities)), len(set(capacities[:-1]))
    assert (use.eager_calls, use.replays, use.graphs) == (distinct, STEPS - distinct, captured)
    assert use.replays > 0 and eager_use.replays == 0


class Losses(Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


class DenseSGD(HSTURecommender):
    """The dense part under plain SGD at lr 1: a weight moves by its gradient, so weights that agree after a
    step say that the gradients agreed. (Adam's first step moves a weight by about lr whatever the size of
    its gradient: one near zero whose sign differs in the last float bit moves the other way.)"""

    def configure_optimizers(self):
        return torch.optim.SGD(self.objectives.parameters(), lr=1.0)


def test_the_fused_attention_trains_like_the_padded_reference():
    """fp32: the jagged layout and the Triton kernel against the padded plain-PyTorch attention: the losses of
    every step, and the gradients of one step (every dense weight and every embedding row after one SGD step;
    after more steps float noise grows with the training itself, measured about 1e-4 after 8 on the H200)."""
    fused_losses, padded_losses = Losses(), Losses()
    train("default_d6", callbacks=[fused_losses], attention="fused")
    train("default_d6", callbacks=[padded_losses], attention="padded")
    # fp32 sums in another order; the temperature (0.05) scales logit differences 20x
    torch.testing.assert_close(
        torch.tensor(fused_losses.losses), torch.tensor(padded_losses.losses), rtol=1e-4, atol=1e-5
    )
    fused = train("default_d6", DenseSGD, attention="fused", steps=1, sparse_lr=1.0)
    padded = train("default_d6", DenseSGD, attention="padded", steps=1, sparse_lr=1.0)
    assert_close_weights(fused, padded)


def test_the_grouped_attention_trains_on_cuda_like_the_padded_one_and_is_not_captured():
    """attention="grouped" (the CPU's default) also runs on a GPU, eagerly, with the padded reference's
    losses; graph capture refuses it, naming the attentions it takes (the groups are read on the host)."""
    grouped_losses, padded_losses = Losses(), Losses()
    train("default_d6", callbacks=[grouped_losses], attention="grouped")
    train("default_d6", callbacks=[padded_losses], attention="padded")
    torch.testing.assert_close(
        torch.tensor(grouped_losses.losses), torch.tensor(padded_losses.losses), rtol=1e-4, atol=1e-5
    )
    with pytest.raises(ValueError, match="with capture_graphs use attention='fused' or 'padded'"):
        train("default_d6", capture_graphs=True, attention="grouped")


def test_the_compiled_token_wise_parts_train_like_eager_ones():
    """compile_layers: the layers' norms, SiLU, gating and residual adds through
    torch.compile, against the same ops run eagerly: the losses of every step, and every weight after one
    SGD step at lr 1 (fp32: only the order of the norms' sums differs)."""
    _compiled_token_wise.cache_clear()
    compiled_losses, eager_losses = Losses(), Losses()
    train("default_d6", callbacks=[compiled_losses], attention="fused", compile_layers=True)
    assert _compiled_token_wise.cache_info().currsize == 1  # the compiled functions ran
    train("default_d6", callbacks=[eager_losses], attention="fused", compile_layers=False)
    torch.testing.assert_close(
        torch.tensor(compiled_losses.losses), torch.tensor(eager_losses.losses), rtol=1e-4, atol=1e-5
    )
    compiled = train("default_d6", DenseSGD, attention="fused", steps=1, sparse_lr=1.0, compile_layers=True)
    eager = train("default_d6", DenseSGD, attention="fused", steps=1, sparse_lr=1.0, compile_layers=False)
    assert_close_weights(compiled, eager)


def test_the_trace_has_a_track_per_cuda_stream_and_consumers_start_after_their_producers(tmp_path):
    path = tmp_path / "trace.json"
    train("full_split_d6", callbacks=[TraceCallback(str(path), first_batch=2, num_batches=3)])
    events = json.loads(path.read_text())["traceEvents"]
    plan = HSTUPipelineStrategy("full_split_d6").plan
    tracks = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name" and e["pid"] == 1}
    assert tracks == {f"stream {t.stream}" for t in plan.tasks}
    device = {(e["name"], e["args"]["batch"]): e for e in events if e["ph"] == "X" and e["pid"] == 1}
    assert Counter(task for task, _ in device) == Counter({t.name: 3 for t in plan.tasks})
    stream_of = {t.name: str(t.stream) for t in plan.tasks}
    checked = 0
    for edge in plan.edges:  # same-batch data across streams: the consumer's GPU work waits for the producer's
        if edge.kind != EdgeKind.ORD or stream_of[edge.producer] == stream_of[edge.consumer]:
            continue
        for (task, batch), consumer in device.items():
            producer = device.get((edge.producer, batch))
            if task == edge.consumer and producer is not None:
                assert consumer["ts"] >= producer["ts"] + producer["dur"] - 1.0, (edge, batch)  # 1 us: event resolution
                checked += 1
    assert checked > 0


def test_one_gpu_step_launches_no_collective(tmp_path, monkeypatch):
    """One GPU, NCCL (world size 1): the step has nothing to reduce or exchange, and the collective inventory
    finds no launch in it (TorchRec skips its all-to-alls at world size 1; the global token count and
    megatron-core's gradient finalisation skip their all-reduces on one rank)."""
    monkeypatch.chdir(tmp_path)
    inventory = CollectiveInventoryCallback(
        batch=4, path=str(tmp_path / "collectives.json"), print_table=False, trace_dir=str(tmp_path / "traces")
    )
    train("full_split_d6", callbacks=[inventory])
    assert inventory.inventory == [], format_inventory(inventory.inventory)
    # the step was traced: its engine task ranges are in the trace the inventory was read from
    events = json.loads((tmp_path / "traces" / "collectives_batch4_rank0.json").read_text())["traceEvents"]
    assert any(e.get("name", "").startswith("[engine] finalize_model_grads@") for e in events)


def test_graph_capture_with_dropout_trains(padded_eager):
    """Dropout inside the captured graphs (fresh random masks on every replay): the run completes on the
    graphs, and the weights move away from the dropout-free run but stay finite."""
    use = GraphUse()
    dense, sparse = train("default_d6", callbacks=[use], capture_graphs=True, dropout=0.1, attention="padded")
    assert (use.replays, use.graphs) == (STEPS - 3, 1)
    assert all(torch.isfinite(v).all() for v in [*dense.values(), *sparse.values()])
    assert any(not torch.allclose(v, padded_eager[0][k]) for k, v in dense.items())
