"""The HSTU step on one device under a plain PyTorch loop, Lightning's own loop, TorchRec's
TrainPipelineSparseDist, the engine's presets and the fastest preset with graph-captured dense compute,
each preset both driven directly (``(Engine)`` rows: ``Engine.run`` over the task bodies) and through the
user's path (``Trainer(strategy=HSTUPipelineStrategy(preset, ...))``; the difference is the strategy's
own cost): steady-state ms/step (median, best and spread of several repeats), samples/s, GPU kernel time per
step, MFU, peak memory, the exposed side chain ("exposed": host ms per step that the tasks of lookahead
> 0 cost the thread running the forward, by running there or by being waited for) and host time per
engine thread. Prints a table.

    python benchmarks/hstu_pipelines.py [--workloads light heavy] [--steps 30] [--repeats 3]
    torchrun --nproc-per-node N benchmarks/hstu_pipelines.py ...     # N ranks (one GPU each, or gloo on CPU)

With several ranks each rank trains its own batches (seeded by rank), the engine's presets balance them
with the workload-balanced shuffler (the plain loop and TorchRec's pipeline do not shuffle), the time of
a step is the slowest rank's, and rank 0 prints per-rank and global samples/s and the shuffler's balance.
Lightning's own loop is left out with several ranks.

Workloads (batch 32, zipf(1.2) history lengths capped at L, a 1M-row item table, bf16 autocast on CUDA):
light: L=256, width 128, 2 layers, 2 heads x 32; heavy: L=1024, width 512, 8 layers, 4 heads x 128;
seed: L=4096, width 1024, 10 layers, 4 heads x 256 (the seed engine's benchmark shape: hidden size 1024,
4 attention heads of 256 channels); seed_w128: the same lengths and depth at width 128, 4 heads x 128.
(The model's token embeddings have the model's width.) ``--small`` shrinks everything for a CPU smoke run.
``--rows`` runs some groups of rows only: run the groups in processes of their own to keep what one mode
leaves behind (its model, engine threads' process groups, captured graphs) out of the next one's time (on
one H200 a user's-path row read 3-4 ms/step slower after the other rows than alone, BENCHMARKS.md).
Each row runs ``--warmup`` batches of its own, then ``--warm-passes`` untimed passes over the measured
batches (graphed rows at least ``GRAPH_WARM_PASSES``), then its timed windows over them.

``--attention padded fused`` runs every mode with the padded reference attention and with the fused
jagged kernel, one block each; ``--shuffler balanced identity`` (several ranks) with and without the
workload-balanced shuffle, so that its cost and what the engine hides of it show. MFU: the model FLOPs of
the measured batches (``HSTUObjectives.training_flops``, the formula in BENCHMARKS.md) over the step time,
against the H200's 989 TFLOP/s dense bf16 peak ("of 790": against the 790 TFLOP/s a bf16 matrix product
reaches there).
"peak GiB": the most GPU memory allocated during the mode.
"""

import argparse
import contextlib
import gc
import itertools
import os
import platform
import statistics
import sys
import time
from collections import defaultdict

import gpu_clocks
import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from workloads import WORKLOADS

from hstu_baselines import FinalizingOptimizer, PipelineBatch, PipelineModel, engine_bodies, plain_step
from idle_gaps import idle_gaps, profile_trace, ranged_bodies, report_gaps

from lightning_hstu import PRESET_NAMES, Engine, HSTUPipelineStrategy, get_plan
from lightning_hstu.hstu.batch import HSTUBatch
from lightning_hstu.hstu.dense_grads import MegatronDenseGrads
from lightning_hstu.hstu.graphs import GraphedMethod
from lightning_hstu.hstu.shuffler import BalancedShuffler, shuffle_group
from lightning_hstu.hstu.sparse import INPUT_DIST_GROUPS, ShardedEmbeddings
from lightning_hstu.hstu.tasks import GRAPH_TASKS
from lightning_hstu.models.hstu import JAGGED_GRAPHS, HSTURecommender, dense_adamw, embedding_tables
from lightning_hstu.models.hstu_layers import HSTULayer

PEAK_TFLOPS, MEASURED_TFLOPS = 989.0, 790.0
"""H200 dense bf16: the datasheet's peak, and what a large bf16 matrix product reaches on that machine."""
SMALL = dict(max_len=32, embedding_dim=16, num_layers=1, num_heads=2, attention_dim=8, hidden_dim=8)


def make_batches(count, batch_size, max_len, num_items, negatives, seed=0):
    """Pinned HSTUBatches with zipf(1.2)-like lengths (P(length > x) ~ x^-0.2), capped at max_len."""
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        lengths = torch.rand(batch_size, generator=gen).pow(-5.0).long().clamp(2, max_len)
        events = int(lengths.sum())
        values = [
            torch.randint(1, num_items + 1, (events,), generator=gen),
            torch.randint(1, num_items + 1, (batch_size * negatives,), generator=gen),
            torch.randint(0, 5, (events,), generator=gen),
            torch.randint(1, 1000, (batch_size,), generator=gen),
            torch.cumsum(torch.randint(0, 3600, (events,), generator=gen), 0),
        ]
        key_lengths = [
            lengths,
            torch.full((batch_size,), negatives),
            lengths,
            torch.ones(batch_size, dtype=torch.long),
            lengths,
        ]
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=["item", "item_neg", "action", "user", "time"],
            values=torch.cat(values),
            lengths=torch.cat(key_lengths),
        )
        batch = HSTUBatch(kjt, sequence_keys=("item", "action", "time"))
        batches.append(batch.pin_memory() if torch.cuda.is_available() else batch)
    return batches


def model_sizes(sizes, attention="auto") -> dict:
    """HSTURecommender's arguments for a workload."""
    return dict(
        embedding_dim=sizes["embedding_dim"],
        num_layers=sizes["num_layers"],
        num_heads=sizes["num_heads"],
        attention_dim=sizes["attention_dim"],
        hidden_dim=sizes["hidden_dim"],
        max_seq_len=sizes["max_len"],
        dropout=0.0,
        attention=attention,
        retrieval_loss="sampled",
        compile_layers=sizes.get("compile_layers", False),
        autocast_residual=sizes.get("autocast_residual", True),
        input_dist_group=sizes.get("input_dist_group", "world"),
    )  # 16 sampled negatives per history


def build_model(sizes, device, num_items, world=1, attention="auto", balance=True, own_group=True):
    torch.manual_seed(0)
    model = HSTURecommender(**model_sizes(sizes, attention), num_items=num_items, num_users=1000, num_actions=5).to(
        device
    )
    model.embeddings = ShardedEmbeddings(
        embedding_tables(sizes["embedding_dim"], num_items, 1000, 5),
        device,
        input_dist_group=model.hparams.input_dist_group,
    )
    model.dense_grads = MegatronDenseGrads(model.objectives)
    model.shuffler = BalancedShuffler(
        32,
        group=shuffle_group(balance and own_group),
        enabled=balance and world > 1,
        sizes_group=shuffle_group(balance and own_group, backend="gloo"),
    )
    return model


def timed(run, steps_batches, device):
    _sync(device)
    dist.barrier()  # every rank starts together; the slowest rank's time is the step time
    start = time.perf_counter()
    extra = run(steps_batches)
    _sync(device)
    ms = torch.tensor([(time.perf_counter() - start) * 1e3 / len(steps_batches)], dtype=torch.float64)
    if dist.get_world_size() > 1:
        ms = ms.to(device)
        dist.all_reduce(ms, op=dist.ReduceOp.MAX)
    return float(ms), extra


def run_plain(model, optimizer, autocast):
    def run(batches):
        for batch in batches:
            plain_step(model, optimizer, batch, autocast=autocast)

    return run


def run_pipeline(model, optimizer, autocast, device):
    pipeline = TrainPipelineSparseDist(
        PipelineModel(model, autocast), FinalizingOptimizer(optimizer, model.dense_grads), device
    )

    def run(batches):
        iterator = iter([PipelineBatch.of(b) for b in batches])
        while True:
            try:
                pipeline.progress(iterator)
            except StopIteration:
                return

    return run


def run_engine(model, optimizer, autocast, device, preset, capture=False, ranges=False, check_finite=False):
    """``ranges``: each task body inside a ``record_function`` range (for ``--gaps``); ``check_finite``: the
    loss checked as the user's path with ``on_nonfinite_loss="stop"`` checks it (``engine_bodies``)."""
    losses = []
    accumulators = model.dense_grads.accumulators()  # as HSTURecommender.hstu_graphs
    graphed = (  # as many capacities as the user's path captures
        GraphedMethod(model.objectives, "losses", max_graphs=JAGGED_GRAPHS, accumulators=accumulators)
        if capture
        else None
    )
    plan = get_plan(preset, capturable=GRAPH_TASKS if capture else ())
    bodies = engine_bodies(model, optimizer, losses, autocast=autocast, graphed=graphed, check_finite=check_finite)
    engine = Engine(
        plan,
        ranged_bodies(bodies) if ranges else bodies,
        device=device if device.type == "cuda" else None,
        step_timeout=600,
        graphs={"forward": graphed} if capture else None,
    ).start()

    def run(batches):
        records = engine.run(batches)
        losses.clear()
        return records

    return run, engine


class _Batches(pl.LightningDataModule):
    """The benchmark's batches as a data module (what HSTURecommender.configure_model reads)."""

    def __init__(self, batches, num_items):
        super().__init__()
        self.batches, self.num_items, self.num_users, self.num_actions = batches, num_items, 1000, 5
        self.batch_size = batches[0].size

    def train_dataloader(self):
        return DataLoader(self.batches, batch_size=None, collate_fn=lambda b: b, pin_memory=False)


class _StepTimer(pl.Callback):
    """Times windows of ``steps`` steps after ``warmup`` (GPU synchronised at the window edges only), counts
    the caching allocator's calls into CUDA over the timed windows (per step, as ``measure`` does) and profiles
    the kernels of the window after the last timed one. ``spans``: each timed window's and the profiled one's
    start and end (``time.perf_counter()``)."""

    def __init__(self, warmup, steps, repeats, device):
        self.warmup, self.steps, self.repeats, self.device = warmup, steps, repeats, device
        self.spans, self.kernel_ms, self._start, self._profiler = [], None, None, None
        self.allocator, self._allocator_before = {}, None

    @property
    def times(self) -> list[float]:
        """Each timed window's ms per step."""
        return [(end - start) * 1e3 / self.steps for start, end in self.spans[: self.repeats]]

    def _edge(self, batch_idx):
        done = batch_idx - self.warmup
        return done >= 0 and done % self.steps == 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self._edge(batch_idx):
            _sync(self.device)
            if self._start is not None:
                self.spans.append((self._start, time.perf_counter()))
            if self._start is None:
                self._allocator_before = _allocator_calls(self.device)
            elif len(self.spans) == self.repeats and not self.allocator:
                self.allocator = _allocator_calls_since(self._allocator_before, self.device, self.repeats * self.steps)
            if len(self.spans) == self.repeats and self._profiler is None and self.device.type == "cuda":
                self._profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
                self._profiler.__enter__()
            self._start = time.perf_counter()

    def on_train_end(self, trainer, pl_module):
        _sync(self.device)
        if self._start is not None and len(self.spans) <= self.repeats:
            self.spans.append((self._start, time.perf_counter()))  # the profiled window
        if self._profiler is not None:
            self._profiler.__exit__(None, None, None)
            self.kernel_ms = _kernel_ms(self._profiler, self.steps)


class _StepRecords(pl.Callback):
    """The engine's task records of the steps after ``warmup`` (``strategy.step_records``)."""

    def __init__(self, warmup):
        self.warmup, self.records, self.steps = warmup, [], 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx >= self.warmup:
            self.records.extend(getattr(trainer.strategy, "step_records", ()))
            self.steps += 1


class EagerOptimizerStep(HSTURecommender):
    """Graph capture of the dense part with torch's AdamW stepping eagerly (as before GraphedAdamW): what
    capturing the step saves."""

    def configure_optimizers(self):
        hp = self.hparams
        return dense_adamw(self.objectives.parameters(), lr=hp.lr, weight_decay=hp.weight_decay, betas=tuple(hp.betas))


def cycled(batches, total):
    """``total`` batches: ``batches`` over and over."""
    return (batches * (total // len(batches) + 1))[:total]


GRAPH_WARM_PASSES = 4
"""Untimed passes over the measured batches before a graphed row's timed windows. ``GraphedMethod`` captures a
signature (a token capacity) after its third eager call, at the next step boundary: for a capacity that only the
third pass's last batch met the third time, that is the next pass's first step, so a fourth pass keeps its
capture (which synchronises and allocates) out of the timed windows; with three, one such capture landed in a
timed window of the seed's graphed row (its spread, 42.6 ms per step, BENCHMARKS.md)."""


def row_warm_passes(warm_passes: int, graphed: bool) -> int:
    """A row's untimed passes over the measured batches before its timed windows: ``--warm-passes``, and at
    least ``GRAPH_WARM_PASSES`` for a graphed row. Without one the first timed window of an eager row is the
    first to meet the measured batches (their token counts' first products, the allocator's growth to the
    largest), and the median of three windows is the slower of the other two."""
    return max(warm_passes, GRAPH_WARM_PASSES if graphed else 0)


def window_count(warm_passes, repeats, gaps=False) -> int:
    """The windows a row runs over the measured batches after its warm-up: its untimed passes, its timed
    windows, the kernel profile and, with ``gaps``, the idle gaps' profile."""
    return warm_passes + repeats + 1 + bool(gaps)


def windowed(batches, warmup, repeats, warm_passes=0):
    """The user's path's batches and its timed windows' start: ``batches[:warmup]`` once, then the measured
    ones, ``batches[warmup:]``, for ``warm_passes`` untimed windows, ``repeats`` timed ones and the profiled
    one, so that every window runs the batches that ``measure`` times, in its order (``cycled`` over all of
    them would bring warm-up batches into the later windows). Returns the batches and the steps before the
    first timed window."""
    steps = len(batches) - warmup
    return batches[:warmup] + batches[warmup:] * window_count(warm_passes, repeats), warmup + warm_passes * steps


def user_path_trainer(strategy, device, total, callbacks) -> pl.Trainer:
    """The Trainer of the user's-path rows (one device per rank, bf16 on CUDA, ``total`` steps, nothing
    but the step: no logger, checkpoint, progress bar or validation); also ``profile_user_path.py``'s."""
    return pl.Trainer(
        strategy=strategy,
        accelerator=device.type,
        devices=dist.get_world_size() if dist.is_initialized() else 1,
        use_distributed_sampler=False,
        precision="bf16-mixed" if device.type == "cuda" else "32-true",
        max_steps=total,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=callbacks,
    )


def measure_trainer(
    mode,
    strategy,
    sizes,
    batches,
    warmup,
    repeats,
    device,
    num_items,
    attention,
    balance=True,
    nonfinite="raise",
    model_class=HSTURecommender,
    warm_passes=0,
    clocks=None,
):
    """The user's path: ``Trainer(strategy=strategy)`` over the same batches and model sizes (with
    ``HSTUPipelineStrategy(engine=False)``: Lightning's own loop), timed as ``measure`` times: windows of the
    batches after ``warmup`` (``windowed``). ``warm_passes``, ``clocks``: as ``measure``'s."""
    steps = len(batches) - warmup
    torch.manual_seed(0)
    model = model_class(
        **model_sizes(sizes, attention),
        sparse_optimizer="sgd",
        lr=1e-4,
        balance_batches=balance,
        on_nonfinite_loss=nonfinite,
    )
    data, warmup = windowed(batches, warmup, repeats, warm_passes)
    timer, recorder = _StepTimer(warmup, steps, repeats, device), _StepRecords(warmup)
    trainer = user_path_trainer(strategy, device, len(data), [timer, recorder])
    _reset_peak(device)
    trainer.fit(model, _Batches(data, num_items))
    times = timer.times
    timed_spans, profiled_span = timer.spans[:repeats], timer.spans[repeats : repeats + 1]
    return {
        **_clocks_of(clocks, timed_spans, profiled_span),
        "allocator": timer.allocator,
        "mode": mode,
        "ms": statistics.median(times),
        "best": min(times),
        "spread": max(times) - min(times),
        "kernel_ms": timer.kernel_ms,
        "records": recorder.records or None,
        "record_steps": recorder.steps,
        "peak_gib": _peak_gib(device),
        "plan": strategy.plan if strategy.use_engine else None,
    }


def exposed_side_chain_ms(records, plan, steps) -> float | None:
    """Host time per step that the side chain (the tasks of lookahead > 0) costs the thread that runs the
    forward: side-chain tasks it runs itself, and its waits on side-chain producers of other threads."""
    if not records or plan is None:
        return None
    compute = plan.task("forward").thread
    side = {t.name for t in plan.tasks if t.lookahead > 0}
    exposed = sum(
        r.duration + r.wait if r.task in side else r.wait
        for r in records
        if r.thread == compute and (r.task in side or side & set(r.waited_on))
    )
    return exposed * 1e3 / steps


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def kernels_per_step(run, batches, device):
    """GPU kernel ms per step, and each kernel's (name, ms per step, launches per step), heaviest first."""
    if device.type != "cuda":
        return None, []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run(batches)
        _sync(device)
    steps = len(batches)
    kernels = sorted(
        ((e.key, e.self_device_time_total / 1e3 / steps, e.count / steps) for e in prof.key_averages()),
        key=lambda k: -k[1],
    )
    return sum(ms for _, ms, _ in kernels), [k for k in kernels if k[1] > 0]


def kernel_differences(base, other):
    """Per kernel name, ``other``'s ms and launches per step minus ``base``'s (lists as ``kernels_per_step``
    gives them), the largest differences in ms first."""
    ms, launches = defaultdict(float), defaultdict(float)
    for sign, kernels in ((-1, base), (1, other)):
        for name, kernel_ms, count in kernels:
            ms[name] += sign * kernel_ms
            launches[name] += sign * count
    return sorted(((name, ms[name], launches[name]) for name in ms), key=lambda k: -abs(k[1]))


def _kernel_ms(profiler, steps) -> float:
    """GPU kernel milliseconds per step recorded by a CUDA-activity profiler."""
    return sum(e.self_device_time_total for e in profiler.key_averages()) / 1e3 / steps


def fresh_windows(batches, steps):
    """``batches`` cut into windows of ``steps`` batches (``--fresh``), in order."""
    return [batches[i : i + steps] for i in range(0, len(batches) - steps + 1, steps)]


def measure(
    name,
    run,
    batches,
    warmup,
    repeats,
    device,
    warm_passes=0,
    plan=None,
    gaps=False,
    fresh=0,
    collector="python",
    clocks=None,
):
    """``warm_passes``: passes over the measured batches before timing (graph capture needs each input
    signature, e.g. each token capacity, seen a few times first). ``gaps``: also the GPU's idle time between
    kernels, from a profile with CPU ops (idle_gaps.py), after the kernel profile. ``fresh``: every window
    (warm pass, timed window, profile) runs ``fresh`` batches of its own, the next of ``batches[warmup:]``
    (``fresh_windows``), so that no timed step meets a batch, nor likely a token count, met before (as in a
    training run); 0: every window runs all of ``batches[warmup:]``. ``collector``: Python's garbage collector
    from the end of the warm passes to the end of the profiles (``COLLECTOR_MODES``). ``clocks``: a running
    ``gpu_clocks.ClockSampler``, read over each timed window and over the kernel profile."""
    _reset_peak(device)
    run(batches[:warmup])
    passes = window_count(warm_passes, repeats, gaps)
    windows = fresh_windows(batches[warmup:], fresh) if fresh else [batches[warmup:]] * passes
    if len(windows) < passes:
        raise ValueError(f"--fresh: {passes} windows of {fresh} batches needed after the warm-up, {len(windows)} made")
    windows = iter(windows)
    for _ in range(warm_passes):
        run(next(windows))
    times, records, record_steps, timed_batches = [], None, 0, []
    window_allocator, window_collector, spans = [], [], []
    with collector_mode(collector):
        start = _allocator_calls(device), _collections()
        for _ in range(repeats):
            window = next(windows)
            began = time.perf_counter()
            ms, extra = timed(run, window, device)
            spans.append((began, time.perf_counter()))
            times.append(ms)
            end = _allocator_calls(device), _collections()
            window_allocator.append(_minus(end[0], start[0]))
            window_collector.append(_minus(end[1], start[1]))
            start = end
            timed_batches += window
            if isinstance(extra, list):  # the engine's task records of this window's steps
                records, record_steps = extra, len(window)
        measured = next(windows)
        began = time.perf_counter()
        kernel_ms, kernels = kernels_per_step(run, measured, device)
        profiled_span = [(began, time.perf_counter())]
        profile = gaps and device.type == "cuda"
        idle = idle_gaps(profile_trace(run, next(windows), device), len(measured)) if profile else None
    allocator = {key: n / len(timed_batches) for key, n in _summed(window_allocator).items()}
    return {
        "timed": timed_batches,
        "profiled": measured,
        "windows": times,
        "window_allocator": window_allocator,
        "window_collector": window_collector,
        **_clocks_of(clocks, spans, profiled_span),
        "allocator": allocator,
        "gaps": idle,
        "mode": name,
        "ms": statistics.median(times),
        "best": min(times),
        "spread": max(times) - min(times),
        "kernel_ms": kernel_ms,
        "kernels": kernels,
        "records": records,
        "record_steps": record_steps,
        "peak_gib": _peak_gib(device),
        "plan": plan,
    }


ALLOCATOR_CALLS = {"num_device_alloc": "cudaMalloc", "num_device_free": "cudaFree", "num_alloc_retries": "retries"}
"""The caching allocator's counters read around the timed steps: its calls into CUDA (a cudaFree waits for the
device) and its retries (every cached block freed, then cudaMalloc again)."""


def windows_line(row) -> str:
    """Each timed window's ms per step, in order, each with the caching allocator's calls in that window where
    it made any (a retry frees every cached block and allocates again, a cost a window of its own shows), and
    the time Python's garbage collector ran in it, with its collections, where it ran (a collection holds the
    GIL: every Python thread of the step waits for it, and a full one scans every object the process made)."""
    clocks = row.get("window_clocks") or [None] * len(row["windows"])
    windows = ", ".join(
        f"{ms:.2f}{_window_notes(made, collected, clock)}"
        for ms, made, collected, clock in zip(row["windows"], row["window_allocator"], row["window_collector"], clocks)
    )
    return f"ms per step in each timed window of '{row['mode']}', in order: {windows}"


def _window_notes(calls: dict, collected: dict, clocks: dict | None = None) -> str:
    made = [f"{n} {ALLOCATOR_CALLS[key]}" for key, n in calls.items() if n]
    if collected["collections"]:
        full = f", {collected['full']} full" if collected["full"] else ""
        made.append(f"gc {collected['ms']:.1f} ms, {_collections_text(collected['collections'])}{full}")
    if clocks:
        made.append(gpu_clocks.note(clocks))
    return f" ({', '.join(made)})" if made else ""


def _clocks_of(clocks, timed_spans: list, profiled_span: list) -> dict:
    """A row's clock readings (``--clocks``: ``clocks`` a ``gpu_clocks.ClockSampler``, else None): each timed
    window's, the timed windows' together, and the kernel profile's (``profiled_span``: its span, or none)."""
    if clocks is None:
        return {"window_clocks": [None] * len(timed_spans), "timed_clocks": None, "profile_clocks": None}
    return {
        "window_clocks": [clocks.between(start, end) for start, end in timed_spans],
        "timed_clocks": clocks.during(timed_spans),
        "profile_clocks": clocks.during(profiled_span) if profiled_span else None,
    }


def clocks_line(row) -> str | None:
    """The GPU's clock over a row's timed windows together and over its kernel profile (``--clocks``): the
    kernel time of the table's "kernel ms" ran at the profile's clock, the step at the windows'."""
    timed = row.get("timed_clocks")
    if timed is None:
        return None
    profile = row.get("profile_clocks")
    limits = f"; clock limited by: {', '.join(timed['reasons'])}" if timed["reasons"] else ""
    least = f", least {timed['min_mhz']:.0f} MHz" if timed["min_mhz"] is not None else ""
    during = f"; during its kernel profile {gpu_clocks.note(profile)}" if profile else ""
    return (
        f"the GPU during the timed windows of '{row['mode']}': {gpu_clocks.note(timed)}{least} "
        f"({timed['readings']} readings){limits}{during}"
    )


def _collections_text(n: int) -> str:
    return f"{n} collection{'' if n == 1 else 's'}"


def _minus(end: dict, start: dict) -> dict:
    return {key: end[key] - start[key] for key in end}


def _summed(windows: list[dict]) -> dict:
    """The counts of several windows (``_minus`` of two reads each) added key by key."""
    return {key: sum(window[key] for window in windows) for key in windows[0]}


COLLECTOR_MODES = {
    "python": "Python's collector as it runs by default",
    "freeze": "gc.freeze() at the end of the warm passes: no collection scans the objects made until then again "
    "(the model, compiled code, caches), a full one only those made since",
    "off": "gc.disable(): no collection at all, the collector's whole cost",
}


@contextlib.contextmanager
def collector_mode(mode: str):
    """Python's garbage collector set to ``mode`` (``COLLECTOR_MODES``) inside; as before after."""
    if mode not in COLLECTOR_MODES:
        raise ValueError(f"collector mode {mode!r}: choose one of {sorted(COLLECTOR_MODES)}")
    enabled = gc.isenabled()
    if mode == "freeze":
        gc.freeze()
    elif mode == "off":
        gc.disable()
    try:
        yield
    finally:
        if mode == "freeze":
            gc.unfreeze()
        elif enabled:
            gc.enable()


class _Collections:
    """Python's garbage collections in this process, counted and timed through ``gc.callbacks`` (a collection
    runs in the thread whose allocation set it off; one runs at a time)."""

    def __init__(self):
        self.collections, self.full, self.ms, self._began = 0, 0, 0.0, 0.0
        gc.callbacks.append(self._called)

    def _called(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
            return
        self.collections += 1
        self.full += info["generation"] == 2
        self.ms += (time.perf_counter() - self._began) * 1e3

    def read(self) -> dict:
        return {"collections": self.collections, "full": self.full, "ms": self.ms}


_COLLECTIONS: _Collections | None = None


def _collections() -> dict:
    """The collections so far, counted from the first read: the counter goes into ``gc.callbacks`` then, not when
    this module is imported (the tests and the other benchmarks import it), and the windows read differences."""
    global _COLLECTIONS
    if _COLLECTIONS is None:
        _COLLECTIONS = _Collections()
    return _COLLECTIONS.read()


def _allocator_calls(device) -> dict:
    stats = torch.cuda.memory_stats(device) if device.type == "cuda" else {}
    return {key: stats.get(key, 0) for key in ALLOCATOR_CALLS}


def _allocator_calls_since(before: dict, device, steps: int) -> dict:
    """The allocator's calls per step over ``steps`` steps since ``before`` (``_allocator_calls``) was read."""
    return {key: n / steps for key, n in _minus(_allocator_calls(device), before).items()}


def _reset_peak(device):
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak_gib(device):
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def step_flops(model, batches, negatives):
    """Mean model FLOPs per step of ``batches`` (HSTUObjectives.training_flops)."""
    return statistics.mean(model.objectives.training_flops(b.sequence_lengths().tolist(), negatives) for b in batches)


def mfu(result, flops) -> float:
    return flops / (result["ms"] * 1e-3) / (PEAK_TFLOPS * 1e12)


def ratio(result) -> float:
    return result["ms"] / result["kernel_ms"]


def thread_host_ms(records, steps):
    per_thread = defaultdict(float)
    for r in records or []:
        per_thread[r.thread] += r.duration * 1e3
    return " ".join(f"{t}={v / steps:.2f}" for t, v in per_thread.items())


ROWS = ("plain", "engine", "user", "lightning", "pipeline")
"""Groups of rows (``--rows``): the plain loop; the presets driven directly (and the fastest with graphs);
the presets through the Trainer (with graphs and with ``on_nonfinite_loss="stop"`` for the fastest);
Lightning's own loop; TorchRec's pipeline."""


def fastest_preset(results, suffix=""):
    rows = [r for r in results if r["mode"].endswith(suffix) and r["mode"].removesuffix(suffix) in PRESET_NAMES]
    return min(rows, key=lambda r: r["ms"])["mode"].removesuffix(suffix) if rows else None


def run_modes(args, sizes, batches, device, autocast, num_items, world, attention, shuffler, clocks=None):
    balance = shuffler != "identity"
    rows = set(args.rows)
    model = optimizer = None
    if rows & {"plain", "engine", "pipeline"}:  # the rows that drive one model directly share it
        model = build_model(sizes, device, num_items, world, attention, balance, own_group=shuffler == "balanced")
        optimizer = dense_adamw(model.objectives.parameters(), lr=1e-4)

    def measure_(name, run, graphed=False, plan=None, gaps=False):
        fresh = args.steps if args.fresh else 0
        passes = row_warm_passes(args.warm_passes, graphed)
        return measure(
            name, run, batches, args.warmup, args.repeats, device, passes, plan, gaps, fresh, args.gc, clocks
        )

    def user_path(name, nonfinite="raise", model_class=HSTURecommender, **strategy_args):
        return measure_trainer(
            name,
            HSTUPipelineStrategy(**strategy_args),
            sizes,
            batches,
            args.warmup,
            args.repeats,
            device,
            num_items,
            attention,
            balance,
            nonfinite,
            model_class,
            warm_passes=row_warm_passes(args.warm_passes, bool(strategy_args.get("capture_graphs"))),
            clocks=clocks,
        )

    results = [measure_("plain loop", run_plain(model, optimizer, autocast))] if "plain" in rows else []
    eager = "eager" in args.engine_rows
    for preset in args.presets if "engine" in rows and eager else ():
        run, engine = run_engine(model, optimizer, autocast, device, preset, ranges=bool(args.gaps))
        try:
            results.append(measure_(f"{preset} (Engine)", run, plan=engine.plan, gaps=bool(args.gaps)))
        finally:
            engine.close()
    best = fastest_preset(results, " (Engine)") if eager else args.presets[0] if "engine" in rows else None
    if device.type == "cuda" and best and "graphs" in args.engine_rows:
        run, engine = run_engine(model, optimizer, autocast, device, best, capture=True, ranges=bool(args.gaps))
        try:
            results.append(
                measure_(
                    f"{best} + graphs (Engine)",
                    run,
                    graphed=True,
                    plan=engine.plan,
                    gaps=bool(args.gaps),
                )
            )
            print(f"captured: {engine.captured}") if dist.get_rank() == 0 else None
        finally:
            engine.close()
    user_rows = set(args.user_rows)
    if "user" in rows and shuffler != "balanced_step_group":  # the model's shuffler has its own group
        if "presets" in user_rows:
            results += [user_path(preset, preset=preset, step_timeout=600) for preset in args.presets]
        # without Engine rows: the fastest through the Trainer, or the first preset where none ran
        best = best or fastest_preset(results) or args.presets[0]
        if device.type == "cuda" and best and "graphs" in user_rows:
            results.append(user_path(f"{best} + graphs", preset=best, capture_graphs=True, step_timeout=600))
            results.append(
                user_path(
                    f"{best} + graphs, optimizer eager",
                    model_class=EagerOptimizerStep,
                    preset=best,
                    capture_graphs=True,
                    step_timeout=600,
                )
            )
        if best and "stop" in user_rows:  # the loss checked after the step is queued, not before backward
            results.append(user_path(f"{best}, stop", "stop", preset=best, step_timeout=600))
            if device.type == "cuda":
                results.append(
                    user_path(f"{best} + graphs, stop", "stop", preset=best, capture_graphs=True, step_timeout=600)
                )
        if best and args.pin_threads is not None:  # the same through HSTUPipelineStrategy(pin_threads=...)
            pinned = dict(preset=best, step_timeout=600, pin_threads=args.pin_threads)
            results.append(user_path(f"{best}, pin_threads={args.pin_threads}", **pinned))
            if device.type == "cuda":
                name = f"{best} + graphs, stop, pin_threads={args.pin_threads}"
                results.append(user_path(name, "stop", capture_graphs=True, **pinned))
    if "lightning" in rows:
        results.append(user_path("Lightning loop", engine=False))
    if "pipeline" in rows:  # last: TorchRec's pipeline rewrites the sharded module in place when it starts
        results.append(measure_("TrainPipelineSparseDist", run_pipeline(model, optimizer, autocast, device)))
    if model is None:  # for the report's FLOPs only: the dense part, no tables, no process group
        model = HSTURecommender(**model_sizes(sizes, attention), num_items=num_items, num_users=1000, num_actions=5)
    return results, model


def report(say, results, model, measured, negatives, world, steps, kernels=0, gaps=0, fresh=False):
    """``fresh`` (``--fresh``): each row's MFU from the FLOPs of the batches its own timed windows ran; its
    kernel profile ran other batches, so no step/kernel ratio and no time outside kernels (the profiled
    batches' FLOPs instead, beside the timed ones')."""
    flops = step_flops(model, measured, negatives)
    global_column = f" {'global/s':>9}" if world > 1 else ""
    say(f"model {flops / 1e12:.3f} TFLOP per step (rank 0's batches)")
    say(
        f"{'mode':<25} {'ms/step':>8} {'best':>6} {'spread':>7} {'samples/s':>9}{global_column} {'kernel ms':>9} "
        f"{'step/kernel':>11} {'MFU':>6} {'of 790':>6} {'peak GiB':>8} {'exposed':>7}  host ms/step per engine thread "
        f"(rank 0)"
    )
    own_flops = {  # per row: the FLOPs of the batches its timed windows ran
        r["mode"]: step_flops(model, r["timed"], negatives) if fresh and r.get("timed") else flops for r in results
    }
    for r in results:
        kernel, own = r["kernel_ms"], own_flops[r["mode"]]
        global_rate = f" {world * 32e3 / r['ms']:>9.0f}" if world > 1 else ""
        peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.1f}"
        exposed = exposed_side_chain_ms(r["records"], r["plan"], r["record_steps"])
        exposed = "-" if exposed is None else f"{exposed:.2f}"
        step_per_kernel = "-" if not kernel or fresh else f"{ratio(r):.2f}"  # --fresh: other batches profiled
        say(
            f"{r['mode']:<25} {r['ms']:>8.2f} {r['best']:>6.2f} {r['spread']:>7.2f} "
            f"{32e3 / r['ms']:>9.0f}{global_rate} "
            f"{'-' if kernel is None else f'{kernel:9.2f}':>9} {step_per_kernel:>11} "
            f"{mfu(r, own):>6.1%} {mfu(r, own) * PEAK_TFLOPS / MEASURED_TFLOPS:>6.1%} {peak:>8} {exposed:>7}  "
            f"{thread_host_ms(r['records'], r['record_steps'])}"
        )
    for r in results:
        if len(r.get("windows", ())) > 1:
            say(windows_line(r))
    for r in results:
        line = clocks_line(r)
        if line:
            say(line)
    for r in results if kernels else ():
        if r.get("kernels"):
            launches = sum(count for _, _, count in r["kernels"])
            if fresh and r.get("profiled"):
                profiled, timed_flops = step_flops(model, r["profiled"], negatives), own_flops[r["mode"]]
                beside = (
                    f"batches of their own, {profiled / 1e12:.3f} TFLOP per step against the timed "
                    f"{timed_flops / 1e12:.3f}"
                )
            else:
                outside = r["ms"] - r["kernel_ms"]
                beside = f"the step's {outside:.2f} ms outside kernels are {outside * 1e3 / launches:.2f} us per launch"
            say(
                f"the {kernels} heaviest GPU kernels of '{r['mode']}' per step (of {r['kernel_ms']:.2f} ms in "
                f"{launches:.0f} launches; {beside}):"
            )
            for name, ms, launches in r["kernels"][:kernels]:
                say(f"  {ms:8.3f} ms {ms / r['kernel_ms']:6.1%} {launches:6.1f}x  {name[:110]}")
    by_mode = {r["mode"]: r for r in results if r.get("kernels")}
    for mode, graphed in by_mode.items() if kernels else ():
        eager = by_mode.get(mode.replace(" + graphs", "", 1)) if " + graphs" in mode else None
        if eager is not None:  # what the captured step computes besides the eager one's kernels
            say(f"GPU kernels of '{mode}' minus '{eager['mode']}', ms and launches per step, largest first:")
            for name, ms, launches in kernel_differences(eager["kernels"], graphed["kernels"])[:kernels]:
                say(f"  {ms:+8.3f} ms {launches:+7.1f}x  {name[:110]}")
    for r in results:
        if any(r.get("allocator", {}).values()):
            calls = ", ".join(f"{n:.2f} {ALLOCATOR_CALLS[key]}" for key, n in r["allocator"].items())
            say(f"the caching allocator during the timed steps of '{r['mode']}', per step: {calls}")
    for r in results:
        if r.get("window_collector"):
            collected = _summed(r["window_collector"])
            steps = len(r["timed"])
            say(
                f"Python's garbage collector during the timed steps of '{r['mode']}': {collected['ms'] / steps:.2f} ms "
                f"per step, {_collections_text(collected['collections'])} in {steps} steps, {collected['full']} full"
            )
    for r in results if gaps else ():
        if r.get("gaps"):
            report_gaps(say, r["mode"], r["gaps"], gaps)
    before, after, shuffled = model.balance_totals
    if shuffled and world > 1:
        say(
            f"balanced shuffler (engine modes): max/mean rank cost {before / shuffled:.3f} -> "
            f"{after / shuffled:.3f}, mean over {shuffled} global batches"
        )


def busy(us: float) -> None:
    """Spin the calling thread for ``us`` microseconds (host work that holds the GIL, as Python does)."""
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass


def add_host_work(forward_us: float, backward_us: float):
    """``--host-work``: every HSTU layer's attention call followed by ``forward_us`` of busy host time on the
    thread that runs the forward, and its backward preceded by ``backward_us`` on autograd's thread (a hook on
    the attention's output): layers x (forward_us + backward_us) of host work a step, by which a step that waits
    for the host slows and one that waits for the GPU does not. Eager steps only: a captured graph replays
    without it. Returns a function that takes the work out again."""
    attend = HSTULayer.attend

    def attend_with_host_work(self, uvqk, tokens):
        u, y = attend(self, uvqk, tokens)
        if backward_us and y.requires_grad:
            y.register_hook(lambda grad: busy(backward_us))  # None: the gradient goes on unchanged
        if forward_us:
            busy(forward_us)
        return u, y

    HSTULayer.attend = attend_with_host_work

    def remove():
        HSTULayer.attend = attend

    return remove


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=["light", "heavy", "seed"], choices=list(WORKLOADS))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--warm-passes",
        type=int,
        default=0,
        metavar="N",
        help="untimed passes over the measured batches before each row's timed windows (after --warmup's "
        "batches; graphed rows run at least %d; under --fresh each pass runs batches of its own): with 1 or "
        "more, and without --fresh, no timed window is the first to meet its batches" % GRAPH_WARM_PASSES,
    )
    parser.add_argument("--presets", nargs="+", default=list(PRESET_NAMES))
    parser.add_argument("--small", action="store_true", help="tiny sizes, for a CPU smoke run")
    parser.add_argument("--no-lightning", action="store_true", help="leave out Lightning's own loop")
    parser.add_argument("--no-pipeline", action="store_true", help="leave out TorchRec's TrainPipelineSparseDist")
    parser.add_argument("--plain-only", action="store_true", help="only the plain loop (with --kernels: a profile)")
    parser.add_argument(
        "--rows",
        nargs="+",
        default=list(ROWS),
        choices=ROWS,
        help="which groups of rows to run (a process per group keeps one mode's leftovers, e.g. models, "
        "engines and captured graphs, out of the next one's time)",
    )
    parser.add_argument(
        "--engine-rows",
        nargs="+",
        default=["eager", "graphs"],
        choices=["eager", "graphs"],
        help="the Engine rows to run: the presets eagerly, and the fastest of them with graphs (graphs alone: the "
        "first of --presets). On an 80 GB card the seed workload's graphed row runs only in a process of its own, "
        "with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (BENCHMARKS.md)",
    )
    parser.add_argument(
        "--user-rows",
        nargs="+",
        default=["presets", "graphs", "stop"],
        choices=["presets", "graphs", "stop"],
        help="the user's path rows to run: each of --presets; the fastest with graphs (and with torch's AdamW "
        "stepping eagerly); the fastest with on_nonfinite_loss='stop', eager and with graphs",
    )
    parser.add_argument(
        "--gaps",
        type=int,
        default=0,
        metavar="N",
        help="for the Engine rows, the GPU's idle time between kernels per step, by cause, and its N largest "
        "places (task, op at the launch, kernel after the gap), each window's lead before its first GPU event, and "
        "the N largest kernels by launching ops and matrix products by sizes and strides, from a profile with CPU "
        "ops and shapes (idle_gaps.py)",
    )
    parser.add_argument(
        "--fresh",
        action="store_true",
        help="every timed window (and warm pass and profile) of the rows driven directly runs --steps batches of "
        "its own, none met before, as a training run's are (their token counts new to cuBLAS's and Inductor's "
        "caches); without it each window runs the same --steps batches",
    )
    parser.add_argument(
        "--gc",
        default="python",
        choices=list(COLLECTOR_MODES),
        help="Python's garbage collector during the timed windows and profiles of the rows driven directly: "
        + "; ".join(f"{mode}: {what}" for mode, what in COLLECTOR_MODES.items()),
    )
    parser.add_argument(
        "--kernels",
        type=int,
        default=0,
        metavar="N",
        help="print the N heaviest GPU kernels of each mode per step, with the mode's launches per step and its "
        "time outside kernels per launch; and for each '+ graphs' row, its kernels minus the eager row's (the N "
        "largest differences)",
    )
    parser.add_argument(
        "--clocks",
        action="store_true",
        help="read the GPU's SM clock, power draw and clock-limiting reasons (nvidia-smi, every 50 ms) during "
        "each row's timed windows and its kernel profile, and print them per window and per row (rank 0's GPU)",
    )
    parser.add_argument(
        "--pin-threads",
        type=int,
        metavar="CORE",
        help="user's path rows of the fastest preset with HSTUPipelineStrategy(pin_threads=CORE) too",
    )
    parser.add_argument(
        "--no-user-path",
        action="store_true",
        help="leave out the presets through Trainer(strategy=HSTUPipelineStrategy(...))",
    )
    parser.add_argument(
        "--shuffler",
        nargs="+",
        default=["balanced"],
        choices=["balanced", "balanced_step_group", "identity"],
        help="several ranks: the workload-balanced shuffler on its own process group (as "
        "HSTURecommender runs it), the same on the step's group (the Engine rows only), or the "
        "identity (no exchange)",
    )
    parser.add_argument(
        "--attention",
        nargs="+",
        default=["auto"],
        choices=["auto", "fused", "grouped", "padded"],
        help="auto: fused on CUDA, grouped elsewhere (grouped is not captured: no graphs with it on CUDA)",
    )
    parser.add_argument(
        "--compile-layers",
        nargs="+",
        default=["off"],
        choices=["on", "off"],
        help="HSTURecommender(compile_layers=...): the layers' token-wise parts through torch.compile (fused "
        "attention on CUDA only)",
    )
    parser.add_argument(
        "--residual",
        nargs="+",
        default=["autocast"],
        choices=["autocast", "fp32"],
        help="HSTURecommender(autocast_residual=...): the residual stream in autocast's dtype (the default) or "
        "in float32",
    )
    parser.add_argument(
        "--host-work",
        nargs=2,
        type=float,
        metavar=("FORWARD_US", "BACKWARD_US"),
        help="busy host time added after each layer's attention call and before its backward (add_host_work): "
        "whether an eager step waits for the host",
    )
    parser.add_argument(
        "--input-dist-group",
        nargs="+",
        default=["world"],
        choices=list(INPUT_DIST_GROUPS),
        help="HSTURecommender(input_dist_group=...): the tables' input all-to-alls on the step's process group "
        "(TorchRec's) or on one of their own",
    )
    args = parser.parse_args()
    excluded = {"user": args.no_user_path, "lightning": args.no_lightning, "pipeline": args.no_pipeline}
    args.rows = ["plain"] if args.plain_only else [r for r in args.rows if not excluded.get(r)]
    if args.fresh and set(args.rows) & {"user", "lightning"}:
        parser.error("--fresh times the rows driven directly (--rows plain engine pipeline), not the Trainer's")
    if args.warm_passes < 0:
        parser.error(f"--warm-passes: a number of passes, 0 or more, not {args.warm_passes}")
    if args.gc != "python" and set(args.rows) & {"user", "lightning"}:
        parser.error("--gc sets the collector for the rows driven directly (--rows plain engine pipeline) only")
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world)
    say = print if rank == 0 else (lambda *a, **k: None)  # rank 0 reports
    autocast = "cuda" if device.type == "cuda" else None
    num_items = 1000 if args.small else 1_000_000
    negatives = 16
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    say(
        f"# {name}, torch {torch.__version__}, {os.cpu_count()} CPU cores, {world} rank(s); {args.steps} steps "
        f"after {args.warmup} warm-up, median of {args.repeats}; {time.strftime('%Y-%m-%d')}"
    )
    if args.host_work:
        forward_us, backward_us = args.host_work
        add_host_work(forward_us, backward_us)
        say(
            f"# host work added: {forward_us:g} us after each layer's attention, {backward_us:g} us before its backward"
        )
    if args.gc != "python":
        say(f"# garbage collector: {args.gc}, {COLLECTOR_MODES[args.gc]}")
    if args.warm_passes:
        say(f"# {args.warm_passes} untimed pass(es) over the measured batches before each row's timed windows")
    clocks = contextlib.nullcontext()
    if args.clocks and device.type == "cuda":
        clocks = gpu_clocks.ClockSampler(gpu_clocks.nvidia_smi_id(torch.cuda.get_device_properties(device)))
    elif args.clocks:
        say("# --clocks: no GPU, no clocks to read")
    with clocks as sampler:
        for workload in args.workloads:
            run_workload(args, workload, device, autocast, num_items, negatives, rank, world, say, sampler)
    if sampler is not None and sampler.error:
        say(f"# --clocks: {sampler.error}")
    dist.destroy_process_group()
    if world > 1:
        # Each rank ends here, so that torchrun's exit status is the run's: left to the interpreter's exit, gloo's
        # threads can abort a rank whose run succeeded (exit code -6, docs/reliability.md), and torchrun then
        # reports the job failed and stops the other ranks.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def run_workload(args, workload, device, autocast, num_items, negatives, rank, world, say, clocks):
    """Every block of ``workload`` (attention, shuffler, compiled layers, residual, input group), each run and
    reported."""
    sizes = SMALL if args.small else WORKLOADS[workload]
    windows = window_count(row_warm_passes(args.warm_passes, True), args.repeats, args.gaps) if args.fresh else 1
    count = args.warmup + args.steps * windows
    batches = make_batches(count, 32, sizes["max_len"], num_items, negatives, seed=rank)
    tokens = statistics.mean(int(b.sequence_lengths().sum()) for b in batches)
    blocks = itertools.product(args.attention, args.shuffler, args.compile_layers, args.residual, args.input_dist_group)
    for attention, shuffler, compiled, residual, input_group in blocks:
        sizes = {
            **sizes,
            "compile_layers": compiled == "on",
            "autocast_residual": residual == "autocast",
            "input_dist_group": input_group,
        }
        say(f"\n## {workload}, {attention} attention, {shuffler} shuffler: {sizes}, mean {tokens:.0f} events per batch")
        try:
            results, model = run_modes(
                args, sizes, batches, device, autocast, num_items, world, attention, shuffler, clocks
            )
        except torch.cuda.OutOfMemoryError as error:
            say(f"out of memory: {str(error).splitlines()[0]}")
            torch.cuda.empty_cache()
            continue
        report(
            say,
            results,
            model,
            batches[args.warmup :],
            negatives,
            world,
            args.steps,
            args.kernels,
            args.gaps,
            args.fresh,
        )


if __name__ == "__main__":
    main()
