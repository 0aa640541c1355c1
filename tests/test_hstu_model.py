"""The HSTU workload under the engine: every task doing its real job, the watchdog, and the loss that the
global token count makes independent of how ranks split a global batch."""

import csv
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from conftest import engine_threads
from lightning_runs import QUIET, RecordingLogger
from ranks import launch_env, run_on_ranks
from small_hstu import SMALL_MODEL, lengths_apart, small_data

from lightning_hstu import HSTUPipelineStrategy, TaskError
from lightning_hstu.hstu.batch import HSTUBatch
from lightning_hstu.hstu.sparse import ShardedEmbeddings
from lightning_hstu.hstu.step import global_token_loss, global_tokens, in_bags, sparse_features
from lightning_hstu.models.hstu import HSTURecommender, embedding_tables

ROOT = Path(__file__).parent.parent


class Losses(Callback):
    def __init__(self):
        self.losses, self.records = [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))
        self.records.extend(trainer.strategy.step_records)


def fit_hstu(
    model_cls=HSTURecommender,
    epochs=3,
    callbacks=(),
    strategy=None,
    model_kwargs=None,
    ckpt_path=None,
    **trainer_kwargs,
):
    pl.seed_everything(0, verbose=False)
    recorder = Losses()
    model = model_cls(**{**SMALL_MODEL, **(model_kwargs or {})})
    trainer = pl.Trainer(
        **{
            **dict(
                strategy=strategy or HSTUPipelineStrategy("full_split_d6"),
                accelerator="cpu",
                devices=1,
                max_epochs=epochs,
                **QUIET,
                callbacks=[recorder, *callbacks],
            ),
            **trainer_kwargs,
        }
    )
    trainer.fit(model, small_data(), ckpt_path=ckpt_path)
    return model, trainer, recorder


@pytest.mark.usefixtures("no_thread_left")
def test_hstu_trains_with_every_task_doing_its_job():
    _, trainer, recorder = fit_hstu(limit_val_batches=0)
    ran = {}
    for r in recorder.records:
        ran.setdefault(r.task, set()).add(r.skipped)
    assert ran.pop("prefetch_embeddings") == {True}  # no table uses an embedding cache
    assert all(skipped == {False} for skipped in ran.values()), ran
    per_epoch = len(recorder.losses) // 3
    first, last = recorder.losses[:per_epoch], recorder.losses[-per_epoch:]
    assert sum(last) / len(last) < sum(first) / len(first)


def test_validation_reports_the_ranking_metrics_under_both_rankings():
    _, trainer, _ = fit_hstu(epochs=1)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    for ranking in ("all", "unseen"):
        hr1, hr10, hr50 = (metrics[f"val/{ranking}/HR@{k}"] for k in (1, 10, 50))
        assert 0.0 <= hr1 <= hr10 <= hr50 <= 1
        assert metrics[f"val/{ranking}/NDCG@10"] <= metrics[f"val/{ranking}/HR@10"]
    assert metrics["val/unseen/MRR"] >= metrics["val/all/MRR"]  # fewer items ahead of the target


class ExplodesAtBatch3(HSTURecommender):
    """Batch 3's embeddings come back non-finite, so its loss is."""

    def hstu_compute_output_dist(self, b):
        embeddings = self.embeddings.compute_output_dist(b["sparse_input"])
        if b.index == 3:
            item = embeddings["item"]
            # outside autograd: a NaN factor inside the graph would poison the gradients themselves
            embeddings["item"] = JaggedTensor(values=item.values().detach() * float("nan"), lengths=item.lengths())
        b["embeddings"] = embeddings


class SkipsNonFinite(ExplodesAtBatch3):
    def __init__(self, **kwargs):
        super().__init__(on_nonfinite_loss="skip", **kwargs)


class DenseWeights(Callback):
    def __init__(self):
        self.after, self.module = {}, None

    def on_train_start(self, trainer, pl_module):
        self.module = pl_module

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.after[batch_idx] = [p.detach().clone() for p in pl_module.objectives.parameters()]


@pytest.mark.usefixtures("no_thread_left")
def test_the_watchdog_stops_training_at_a_non_finite_loss():
    with pytest.raises(TaskError) as info:
        fit_hstu(ExplodesAtBatch3, limit_val_batches=0)
    assert (info.value.task, info.value.batch) == ("watchdog", 3)
    assert isinstance(info.value.__cause__, FloatingPointError)
    assert engine_threads() == []


@pytest.mark.usefixtures("no_thread_left")
def test_the_watchdog_can_skip_the_step_instead():
    weights = DenseWeights()
    model, trainer, recorder = fit_hstu(SkipsNonFinite, epochs=1, limit_val_batches=0, callbacks=[weights])
    assert model.skipped_batches == [(0, 3)]
    assert recorder.losses[3] == 0.0  # the skipped batch's loss is an exact zero, not NaN
    assert trainer.global_step == 12  # training went on to the end of the epoch
    for before, after in zip(weights.after[2], weights.after[3]):
        assert torch.equal(before, after)  # the skipped batch changed no dense weight
    assert not any(torch.equal(a, b) for a, b in zip(weights.after[3], weights.after[4]))
    assert all(torch.isfinite(p).all() for p in model.objectives.parameters())
    assert all(torch.isfinite(v).all() for v in model.embeddings.local_weights().values())  # no NaN reached the tables


@pytest.mark.usefixtures("no_thread_left")
def test_fit_summary_does_not_count_a_skipped_batch_as_trained(capsys):
    """Two epochs of 12 batches of 8, batch 3 of each skipped (its step not applied), each skip named with its
    epoch: 176 samples trained; it printed 192 before."""
    from lightning_hstu.callbacks import FitSummary

    summary = FitSummary()
    model, _, _ = fit_hstu(SkipsNonFinite, epochs=2, limit_val_batches=0, callbacks=[summary])
    assert model.skipped_batches == [(0, 3), (1, 3)]
    assert summary.samples == 176
    assert "trained 176 samples in 2 epochs" in capsys.readouterr().out


@pytest.mark.usefixtures("no_thread_left")
def test_skip_at_the_last_batch_of_an_accumulation_window_still_applies_the_windows_finite_batches():
    """Under accumulate_grad_batches=4 batch 3 ends the first window: its non-finite loss adds an exact zero to
    the sum of batches 0-2, and the window's dense step applies those (as it does when the non-finite batch is
    inside the window); before, their dense gradients were dropped with it."""
    weights = DenseWeights()
    model, trainer, _ = fit_hstu(
        SkipsNonFinite, epochs=1, limit_val_batches=0, callbacks=[weights], accumulate_grad_batches=4
    )
    assert model.skipped_batches == [(0, 3)]
    assert not any(torch.equal(a, b) for a, b in zip(weights.after[2], weights.after[3]))  # the window's step
    assert all(torch.isfinite(p).all() for p in model.objectives.parameters())


def _global_token_loss(rank, world):
    """Each rank scores half of a global batch; the mean of the rank losses must be the loss of the whole."""
    data = small_data()
    data.setup()
    batches = list(data.train_dataloader())
    whole = HSTUBatch.concat(batches[:2])
    mine = batches[rank]
    torch.manual_seed(0)
    model = HSTURecommender(**SMALL_MODEL, num_items=data.num_items, num_users=data.num_users)
    tables = embedding_tables(SMALL_MODEL["embedding_dim"], data.num_items, data.num_users, data.num_actions)
    model.embeddings = ShardedEmbeddings(tables, torch.device("cpu"))
    tokens = mine.sequence_lengths().sum().float()
    dist.all_reduce(tokens)
    rank_loss = global_token_loss(model.objectives, mine, model.embeddings(model.sparse_features(mine)), tokens)
    mean = rank_loss.detach().clone()
    dist.all_reduce(mean)
    mean /= world
    w_retrieval, w_ranking = model.objectives(whole, model.embeddings(model.sparse_features(whole)))
    single = (w_retrieval + w_ranking) / whole.sequence_lengths().sum()
    return float(mean), float(single)


def test_the_global_token_loss_equals_the_single_process_loss_on_the_whole_batch(tmp_path):
    """With the full softmax (the small model's default: 200 items): every rank scores its events against
    the whole item table, so the loss is additive over samples."""
    for mean, single in run_on_ranks(_global_token_loss, tmp_path):
        assert mean == pytest.approx(single, rel=1e-5)


def _token_counts(rank, world):
    """``global_tokens`` of each rank's batch: with and without the per-key counts on the host."""
    data = small_data()
    data.setup()
    batches = list(data.train_dataloader())
    mine = batches[rank]
    known = mine.features.length_per_key_or_none() is not None
    features = mine.features
    unknown = HSTUBatch(KeyedJaggedTensor(keys=features.keys(), values=features.values(), lengths=features.lengths()))
    return (
        known,
        global_tokens(mine),
        global_tokens(unknown),
        int(sum(b.sequence_lengths().sum() for b in batches[:world])),
    )


@pytest.mark.parametrize("world", [1, 2])
def test_the_global_token_count_is_every_rank_s_events(tmp_path, world):
    """The loss is normalised by the events of all ranks' batches: all-reduced on several ranks; on one
    rank read from the batch's per-key counts on the host (a number, no device work) where it knows
    them, else summed from its lengths."""
    for known, from_counts, from_lengths, events in run_on_ranks(_token_counts, tmp_path, world=world):
        assert known  # the loader's batches carry their per-key counts
        assert isinstance(from_counts, float) == (world == 1)
        assert float(from_counts) == float(from_lengths) == events
        assert isinstance(from_lengths, torch.Tensor)


def _bagged_lookup(rank, world):
    """Each rank looks up its own batch (a different number of ids, so a different number of bags) once as
    the batch holds it and once in bags of at most 4 ids."""
    data = small_data()
    data.setup()
    batch = HSTUBatch.concat(list(data.train_dataloader())[rank : rank + 2 + rank])
    tables = embedding_tables(SMALL_MODEL["embedding_dim"], data.num_items, data.num_users, data.num_actions)
    torch.manual_seed(0)
    embeddings = ShardedEmbeddings(tables, torch.device("cpu"))
    keys = batch.features.keys()
    features = batch.features.split([4, len(keys) - 4])[0]
    bagged = in_bags(features, 4)
    with torch.no_grad():
        whole, in_four = embeddings(features), embeddings(bagged)
    return (
        features.stride(),
        bagged.stride(),
        int(bagged.lengths().max()),
        {k: bool(torch.equal(whole[k].values(), in_four[k].values())) for k in features.keys()},
        {k: bool(torch.equal(features[k].values(), bagged[k].values())) for k in features.keys()},
    )


def test_ids_looked_up_in_small_bags_get_the_rows_of_their_histories(tmp_path):
    """fbgemm's lookup walks a bag's ids one after another, so the features are looked up in bags of
    LOOKUP_BAG ids: the same ids in the same order, every row as before, also when the ranks' batches
    split into different numbers of bags."""
    results = run_on_ranks(_bagged_lookup, tmp_path)
    assert results[0][1] != results[1][1]  # the all-to-alls carried different strides
    for stride, bags, longest, rows_equal, ids_equal in results:
        assert bags > stride and longest <= 4
        assert all(rows_equal.values()) and all(ids_equal.values()), (rows_equal, ids_equal)


def _one_rank_tables(rank, world):
    """The tables as the model shards them on one rank (the default), their state loaded into row-wise
    tables, and a lookup through each."""
    from torchrec.distributed.types import ShardingType

    data = small_data()
    data.setup()
    batch = next(iter(data.train_dataloader()))
    tables = embedding_tables(SMALL_MODEL["embedding_dim"], data.num_items, data.num_users, data.num_actions)
    torch.manual_seed(0)
    default = ShardedEmbeddings(tables, torch.device("cpu"))
    row_wise = ShardedEmbeddings(tables, torch.device("cpu"), sharding_type=ShardingType.ROW_WISE)
    same_shards = _shard_layout(default) == _shard_layout(row_wise)
    row_wise.load_state_dict(default.state_dict())
    features = sparse_features(batch)
    with torch.no_grad():
        a, b = default(features), row_wise(features)
    return (
        sorted(default.sharded._sharding_type_to_sharding),
        same_shards,
        all(torch.equal(a[k].values(), b[k].values()) for k in features.keys()),
    )


def _shard_layout(embeddings):
    """Each table's shards: offsets and sizes."""
    return {
        key: [(m.shard_offsets, m.shard_sizes) for m in value.metadata().shards_metadata]
        for key, value in embeddings.state_dict().items()
    }


def test_on_one_rank_the_tables_are_one_shard_each_as_row_wise_sharding_gives(tmp_path):
    """On one rank the tables are sharded table-wise (no row-wise bucketize of every id before the lookup):
    the same one shard per table as row-wise sharding over one rank, so a checkpoint is the same either
    way and loads into row-wise tables with the same rows."""
    ((kinds, same_shards, same_rows),) = run_on_ranks(_one_rank_tables, tmp_path, world=1)
    assert kinds == ["table_wise"]
    assert same_shards and same_rows


def test_the_synthetic_benchmark_runs_every_task_on_two_ranks(tmp_path):
    env = launch_env()
    script = Path(sys.executable).parent / "lightning-hstu"
    result = subprocess.run(
        [
            str(script),
            "fit",
            "--config",
            str(ROOT / "examples" / "benchmark_synthetic.yaml"),
            "--trainer.devices=2",
            "--trainer.max_steps=20",
            f"--trainer.default_root_dir={tmp_path}",
            "--trainer.callbacks+=lightning_hstu.callbacks.CollectiveInventoryCallback",
            "--trainer.callbacks.init_args.batch=10",
            "--trainer.callbacks.init_args.trace_dir=traces",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {
        m.group(1): (int(m.group(2)), int(m.group(3)))
        for m in re.finditer(r"^(\w+)\s+\w+\s+(\d+)\s+(\d+)\s", result.stdout, re.MULTILINE)
    }
    assert len(rows) == 14, result.stdout[-3000:]
    plan = HSTUPipelineStrategy("default_d6").plan
    for task, (runs, skipped) in rows.items():
        # max_steps=20 trains 20 batches; a task with lookahead la had already run on la more
        assert runs == 20 + plan.task(task).lookahead, task
        assert skipped == (runs if task == "prefetch_embeddings" else 0), task
    before, after = map(float, re.search(r"max/mean rank cost ([\d.]+) -> ([\d.]+)", result.stdout).groups())
    assert after < before
    # the seed's collective table, per task, as launched in the step that trained batch 10
    launched = {}
    for c in json.loads((tmp_path / "collectives.json").read_text()):
        launched.setdefault(c["task"], []).append(c["operation"])
        assert c["payload_bytes"] and c["thread"] == plan.task(c["task"]).thread
    assert launched == {
        "start_shuffle": ["allgather"],  # every rank's feature lengths (from host memory)
        "finish_shuffle": ["allgather"],  # every rank's values
        "start_input_dist": ["alltoall"],  # TorchRec's splits
        "wait_input_dist": ["alltoall", "alltoall"],  # KJT lengths, then ids
        "global_tokens_allreduce": ["allreduce"],
        "compute_output_dist": ["alltoall"],  # embedding output
        "forward": ["allreduce"],  # every rank's loss finite? (the watchdog's agreement)
        "backward": ["alltoall"],  # embedding output, backward
        "finalize_model_grads": ["allreduce"],  # megatron-core's gradient bucket
    }
    # the trace the table was read from is kept, one per rank, with the engine's task ranges in it
    for rank in (0, 1):
        events = json.loads((tmp_path / "traces" / f"collectives_batch10_rank{rank}.json").read_text())["traceEvents"]
        assert any(e.get("name", "").startswith("[engine] finalize_model_grads@") for e in events)


def test_an_embedding_cache_on_cpu_is_refused_with_the_reason():
    class Cached(HSTURecommender):
        def __init__(self, **kwargs):
            super().__init__(cache_load_factor=0.2, **kwargs)

    with pytest.raises(ValueError, match=r"cache_load_factor=0.2 on cpu: .*use None on CPU"):
        fit_hstu(Cached, epochs=1)


@pytest.mark.parametrize(
    "attention",
    [
        pytest.param(
            "fused",
            marks=pytest.mark.skipif(
                os.environ.get("TRITON_INTERPRET") != "1",
                reason="the kernel in Triton's CPU interpreter, which conftest turns on only without CUDA (with "
                "CUDA, tests/test_hstu_cuda.py trains the fused attention against the padded one on the GPU)",
            ),
        ),
        "grouped",
    ],
)
@pytest.mark.parametrize("engine", [True, False])
def test_the_jagged_attentions_train_like_the_padded_reference(monkeypatch, engine, attention):
    """HSTURecommender(attention="fused"), the jagged layout and the Triton kernel (its CPU interpreter here;
    the CUDA default), and attention="grouped" (the CPU default; here a group per length), under the engine
    and under Lightning's own loop: the same losses, step by step, and the same weights as
    attention="padded" (fp32; they sum in another order). Dropout is off (``SMALL_MODEL``): the layouts draw
    their masks over other tokens."""
    lengths_apart(monkeypatch)

    def fit(attention):
        model, _, recorder = fit_hstu(
            epochs=1,
            strategy=HSTUPipelineStrategy("default_d6", engine=engine),
            model_kwargs=dict(attention=attention),
            limit_train_batches=4,
            limit_val_batches=0,
        )
        return model, recorder.losses

    jagged, jagged_losses = fit(attention)
    padded, padded_losses = fit("padded")
    assert len(jagged_losses) == 4
    torch.testing.assert_close(torch.tensor(jagged_losses), torch.tensor(padded_losses), rtol=1e-5, atol=1e-6)
    for (name, got), want in zip(jagged.objectives.state_dict().items(), padded.objectives.state_dict().values()):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=name)


def test_an_unknown_attention_or_a_fused_one_without_cuda_is_refused(monkeypatch):
    with pytest.raises(ValueError, match="unknown attention 'flash'; valid: auto, fused, grouped, padded"):
        HSTURecommender(**SMALL_MODEL, attention="flash")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="attention='fused' runs a Triton kernel: it needs a CUDA device"):
        fit_hstu(epochs=1, model_kwargs=dict(attention="fused"), limit_train_batches=1, limit_val_batches=0)
    assert HSTURecommender(**SMALL_MODEL).objectives.layout(torch.device("cpu")) == "grouped"  # auto on a CPU


def test_bad_recipe_arguments_are_refused_with_the_valid_choices():
    with pytest.raises(ValueError, match="unknown retrieval_loss 'bpr'; valid: auto, full, sampled, in_batch"):
        HSTURecommender(**SMALL_MODEL, retrieval_loss="bpr")
    with pytest.raises(ValueError, match=r"ranking_weight must be at least 0 \(0 turns the ranking loss off\), got -1"):
        HSTURecommender(**SMALL_MODEL, ranking_weight=-1)
    with pytest.raises(ValueError, match="unknown lr_schedule 'linear'; valid: constant, cosine"):
        HSTURecommender(**SMALL_MODEL, lr_schedule="linear")
    with pytest.raises(ValueError, match="unknown input_dist_group 'shared'; valid: world, own"):
        HSTURecommender(**SMALL_MODEL, input_dist_group="shared")
    with pytest.raises(ValueError, match="length_buckets must be 0 .plain shuffle. or a number of batches per pool"):
        small_data(length_buckets=-2)


@pytest.mark.parametrize(
    "make, argument, named",
    [
        # each of these trained before without a word: no layers, zero-wide heads, a softmax turned upside down
        ("hstu", dict(num_layers=0), "num_layers must be at least 1, got 0"),
        ("hstu", dict(num_heads=0), "num_heads must be at least 1, got 0"),
        ("hstu", dict(attention_dim=0), "attention_dim must be at least 1, got 0"),
        ("hstu", dict(temperature=-0.1), "temperature must be greater than 0, got -0.1"),
        ("hstu", dict(temperature=0), "temperature must be greater than 0, got 0"),  # a NaN loss at step 0 before
        ("hstu", dict(num_items=0), "num_items must be at least 1, got 0"),  # read as unset before
        ("hstu", dict(sparse_lr=-1), "sparse_lr must be at least 0, got -1"),  # torch's message named no argument
        ("sasrec", dict(num_heads=0), "num_heads must be at least 1, got 0"),  # "integer modulo by zero" before
        ("data", dict(max_seq_len=0), "max_seq_len must be at least 1, got 0"),  # read as "no cap" before
        ("data", dict(negatives=-1), "negatives must be at least 0, got -1"),
    ],
    ids=lambda value: value if isinstance(value, str) and " " not in value else None,
)
def test_sizes_out_of_range_are_refused_naming_the_argument(make, argument, named):
    from lightning_hstu.models.sasrec import SASRecRecommender

    build = {
        "hstu": lambda: HSTURecommender(**{**SMALL_MODEL, **argument}),
        "sasrec": lambda: SASRecRecommender(**{"embedding_dim": 16, **argument}),
        "data": lambda: small_data(**argument),
    }[make]
    with pytest.raises(ValueError, match=re.escape(named)):
        build()


def test_sasrec_refuses_an_item_table_smaller_than_the_data():
    from lightning_hstu.models.sasrec import SASRecRecommender

    model = SASRecRecommender(embedding_dim=16, num_heads=2, max_seq_len=32, num_items=50)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, **QUIET)
    with pytest.raises(ValueError, match="num_items=50 is smaller than the data's 196 items"):
        trainer.fit(model, small_data())  # an IndexError inside the lookup before


def test_flops_per_batch_is_none_outside_training():
    """ThroughputMonitor reads it at validation and test batches too: it gave the last training batch's
    forward and backward FLOPs there, the same number for every evaluation batch."""
    seen = []

    class Probe(Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            seen.append(("train", module.flops_per_batch))

        def on_validation_batch_end(self, trainer, module, outputs, batch, batch_idx, dataloader_idx=0):
            seen.append(("validate", module.flops_per_batch))

    fit_hstu(epochs=1, callbacks=[Probe()], limit_train_batches=3, limit_val_batches=2)
    assert [stage for stage, _ in seen] == ["train"] * 3 + ["validate"] * 2
    assert all(flops > 0 for stage, flops in seen if stage == "train")
    assert [flops for stage, flops in seen if stage == "validate"] == [None, None]


def test_the_throughput_monitor_counts_histories_and_events_and_divides_by_the_peak_given():
    from lightning_hstu.callbacks import HSTUThroughputMonitor

    logger, monitor = RecordingLogger(), HSTUThroughputMonitor(peak_flops=1e9, window_size=2)
    fit_hstu(
        epochs=1, callbacks=[monitor], limit_train_batches=4, limit_val_batches=0, logger=logger, log_every_n_steps=1
    )
    rows = [row for _, row in logger.rows if "train/device/mfu" in row]
    assert rows  # MFU logged, against the peak given
    for row in rows:
        assert row["train/device/mfu"] == pytest.approx(row["train/device/flops_per_sec"] / 1e9)
    assert max(row["train/samples"] for _, row in logger.rows if "train/samples" in row) == 4 * 8  # histories
    with pytest.raises(ValueError, match="peak_flops must be greater than 0"):
        HSTUThroughputMonitor(peak_flops=0)


def test_a_loss_scaling_precision_is_refused_before_it_scales_the_tables_updates():
    from lightning.pytorch.plugins.precision import MixedPrecision

    scaled = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match=r"scales the loss with a GradScaler.*use precision='bf16-mixed' or '32-true'"):
        fit_hstu(epochs=1, plugins=[scaled], limit_train_batches=2, limit_val_batches=0)


def test_the_full_softmax_refuses_embeddings_looked_up_without_the_item_table():
    data = small_data()
    data.setup()
    batch = next(iter(data.train_dataloader()))
    model = HSTURecommender(**SMALL_MODEL, num_items=data.num_items, num_users=data.num_users)
    fake = {
        key: JaggedTensor(
            values=torch.zeros(len(batch.features[key].values()), 16), lengths=batch.features[key].lengths()
        )
        for key in ("item", "item_neg", "action", "user")
    }
    rows = data.num_items + 1
    with pytest.raises(
        ValueError,
        match=rf"retrieval='full' scores every event against the whole item table.*"
        rf"\({rows} rows\); these embeddings have 32 'item_neg' rows",
    ):
        model.objectives(batch, fake)  # 8 histories x 4 sampled negatives


@pytest.mark.parametrize("engine", [True, False])
def test_the_logger_gets_every_training_metric_at_its_interval(engine, tmp_path):
    """The loss and its parts are logged where Lightning writes to the logger (and nowhere else: a log call
    costs host time): the logger's rows are those of a module that logs everything at every step."""
    from lightning.pytorch.loggers import CSVLogger

    _, trainer, recorder = fit_hstu(
        strategy=HSTUPipelineStrategy("default_d6", engine=engine),
        epochs=1,
        max_steps=7,
        limit_val_batches=0,
        log_every_n_steps=3,
        logger=CSVLogger(tmp_path, name="", version=0),
    )
    # what callbacks and the progress bar see after the fit is the last logged step's loss (step 5, not 6)
    assert float(trainer.callback_metrics["train/loss"]) == pytest.approx(recorder.losses[5], rel=1e-6)
    assert recorder.losses[5] != recorder.losses[6]
    with open(tmp_path / "version_0" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    for name in ("train/loss", "train/retrieval", "train/ranking"):
        assert [int(r["step"]) for r in rows if r[name]] == [2, 5], name
    for row in (r for r in rows if r["train/loss"]):  # the parts of that very step's loss, not of an earlier one
        parts = float(row["train/retrieval"]) + float(row["train/ranking"])
        assert math.isclose(float(row["train/loss"]), parts, rel_tol=1e-5), row


class StopsAtNonFinite(ExplodesAtBatch3):
    def __init__(self, **kwargs):
        super().__init__(on_nonfinite_loss="stop", **kwargs)


@pytest.mark.usefixtures("no_thread_left")
def test_stop_ends_training_at_a_non_finite_loss_after_its_step():
    """on_nonfinite_loss="stop": checked by the watchdog task after the step was queued, so the error comes
    with the step applied (this process's weights are not finite), at the same batch as "raise"."""
    weights = DenseWeights()
    with pytest.raises(TaskError) as info:
        fit_hstu(StopsAtNonFinite, limit_val_batches=0, callbacks=[weights])
    assert (info.value.task, info.value.batch) == ("watchdog", 3)
    assert isinstance(info.value.__cause__, FloatingPointError) and "the step was applied" in str(info.value.__cause__)
    assert sorted(weights.after) == [0, 1, 2]  # batch 3 never ended
    assert not all(torch.isfinite(p).all() for p in weights.module.objectives.parameters())  # it was applied
    assert engine_threads() == []


def test_an_unknown_nonfinite_policy_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="unknown on_nonfinite_loss 'ignore'; valid: raise, skip, stop"):
        HSTURecommender(**SMALL_MODEL, on_nonfinite_loss="ignore")


@pytest.mark.usefixtures("no_thread_left")
def test_the_history_logit_is_trained_with_the_dense_weights_and_checked_on_load(tmp_path):
    """HSTURecommender(history_logit=True): the logit is one of the dense parameters (megatron-core's buffers,
    AdamW) and moves with them; a checkpoint of the model without it is refused by name."""
    model, trainer, _ = fit_hstu(
        epochs=1, model_kwargs=dict(history_logit=True), limit_train_batches=4, limit_val_batches=0
    )
    assert model.objectives.history_logit.item() != 0
    assert any(p is model.objectives.history_logit for p in trainer.optimizers[0].param_groups[0]["params"])
    mismatch = model.checkpoint_mismatch({**model.hparams, "history_logit": False})
    assert mismatch and "history_logit" in mismatch[0]
    recorded_before = {k: v for k, v in model.hparams.items() if k != "history_logit"}  # the argument's default
    assert model.checkpoint_mismatch(recorded_before) == ["history_logit=False in the checkpoint, True here"]


@pytest.mark.parametrize("repeats", [False, True])
def test_sasrec_history_logit_is_in_its_softmax_and_its_scores(repeats):
    """SASRecRecommender(history_logit=True): each position's softmax adds HISTORY_SCALE times the logit to the
    items its history has read (positions 0 .. p), and the ranking scores add it to the history's items."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from lightning_hstu.hstu.batch import HSTUBatch
    from lightning_hstu.models.sasrec import SASRecRecommender

    torch.manual_seed(0)
    model = SASRecRecommender(
        embedding_dim=8, num_layers=1, max_seq_len=8, dropout=0.0, num_items=9, history_logit=True
    )
    with torch.no_grad():
        model.history_logit.fill_(-0.3)
    items = torch.tensor([3, 1, 3, 5, 2, 4] if repeats else [3, 1, 7, 5, 2, 4])
    features = KeyedJaggedTensor.from_lengths_sync(["item"], items, torch.tensor([4, 2]))
    batch = HSTUBatch(features, sequence_keys=("item",))
    hidden, mask = model.encode(batch)
    expected, held_counts = [], 0
    for b, history in enumerate([items[:4], items[4:]]):
        for p in range(len(history) - 1):
            logits = hidden[b, p] @ model.items.weight.T
            held = torch.isin(torch.arange(10), history[: p + 1])
            held_counts += bool(held[history[p + 1]])
            logits = logits + model.HISTORY_SCALE * model.history_logit * held
            logits[0] = -torch.inf
            expected.append(-torch.log_softmax(logits, 0)[history[p + 1]])
    assert held_counts == (1 if repeats else 0)  # the repeated 3 is a target its history holds
    model.log = lambda *args, **kwargs: None  # no Trainer here
    torch.testing.assert_close(model.training_step(batch, 0), torch.stack(expected).mean())
    model.history_logit = None
    plain = model.score_items(batch)
    model.history_logit = torch.nn.Parameter(torch.tensor([-0.3]))
    shift = model.score_items(batch) - plain
    assert torch.allclose(shift[0, items[:4]], torch.tensor(-3.0)) and torch.allclose(
        shift[1, items[4:]], torch.tensor(-3.0)
    )
    assert shift.count_nonzero() == len(set(items[:4].tolist())) + 2


class StepLRs(Callback):
    def __init__(self):
        self.lrs = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.lrs.append(float(optimizer.param_groups[0]["lr"]))


@pytest.mark.parametrize("schedule", ["constant", "cosine"])
def test_the_dense_learning_rate_follows_the_schedule_over_the_fit(schedule):
    """Under the engine, every optimizer step: ``cosine`` from lr down along half a cosine that ends at the
    fit's last step, ``constant`` at lr."""
    lrs = StepLRs()
    _, trainer, _ = fit_hstu(epochs=2, callbacks=[lrs], model_kwargs=dict(lr=0.004, lr_schedule=schedule))
    steps = trainer.estimated_stepping_batches
    assert len(lrs.lrs) == steps == trainer.global_step
    if schedule == "constant":
        expected = [0.004] * steps
    else:
        expected = [0.004 * 0.5 * (1 + math.cos(math.pi * k / steps)) for k in range(steps)]
    assert lrs.lrs == pytest.approx(expected, rel=1e-6, abs=1e-9)
    if schedule == "cosine":
        assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-9)  # after the last step


def test_a_fit_resumed_mid_epoch_goes_on_along_the_same_cosine(tmp_path):
    """The scheduler's state travels in the checkpoint: from the step it resumes at, the resumed fit's rates
    are those of the fit that never stopped."""
    schedule = dict(lr=0.004, lr_schedule="cosine")
    whole = StepLRs()
    saver = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=7, save_top_k=-1, filename="{step}")
    fit_hstu(epochs=2, callbacks=[whole, saver], model_kwargs=schedule, enable_checkpointing=True)
    resumed = StepLRs()
    _, trainer, _ = fit_hstu(epochs=2, callbacks=[resumed], model_kwargs=schedule, ckpt_path=tmp_path / "step=7.ckpt")
    assert trainer.global_step == len(whole.lrs) == 24  # two epochs of 12 batches
    assert resumed.lrs == pytest.approx(whole.lrs[7:], rel=1e-6)


def test_input_all_to_alls_on_their_own_group_need_no_group_on_one_rank():
    """One rank: no all-to-all leaves it, so input_dist_group="own" makes no process group and trains."""
    model, trainer, _ = fit_hstu(
        epochs=1, model_kwargs=dict(input_dist_group="own"), limit_train_batches=2, limit_val_batches=0
    )
    assert model.embeddings.input_group is None
    assert trainer.global_step == 2
