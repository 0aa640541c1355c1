"""Host cost per step of the user's path itself: a LightningModule whose step is a few tiny CPU ops, trained
by a plain PyTorch loop, by Lightning's own loop (single-device, and DDP over the one process), and through
``Trainer(strategy=HSTUPipelineStrategy(...))``: Lightning's loop under the strategy (``engine=False``), and
the engine under each given preset, with the default step timeout and without one (``step_timeout=None``:
no watchdog, the tasks of a one-thread preset and the batches' pulls on the caller's thread). The "Engine"
rows drive the same step through ``Engine`` directly, without Lightning (one process only): the user's path
minus the Engine row of the same preset and timeout is the strategy's own cost. The modes
run in turns in one process, on the CPU. What the step computes is next to nothing, so the differences are
the loops' own host work per step. On a GPU machine that work runs on the host while the GPU computes,
and competes for the GIL with the threads that launch the step.

    python benchmarks/strategy_overhead.py [--steps 3000] [--repeats 5] [--presets legacy_none default_d6] \
        [--pin-threads CORE] [--devices 2] [--every-hook]

Prints per mode the median over repeats of the us per step (each repeat a fresh Trainer; the first
``--warmup`` steps of each are not timed), their spread, and the difference to the plain loop. With
``--devices N`` (N > 1) every mode runs on N gloo ranks that Lightning's launcher starts (rank 0 prints;
the plain loop and the single-device loop are left out, the differences are to Lightning's DDP loop). With
``--every-hook`` the user's path rows also run with Lightning's own hook dispatchers, every per-batch hook
dispatched through them as Lightning's loop does (without ``loops/hook_calls.py``: the epoch loop skips the
hooks that nothing overrides and makes the other calls without Lightning's log line and profiler section).
"""

import argparse
import contextlib
import os
import platform
import statistics
import time
import warnings

import lightning.pytorch as pl
import torch
from profile_user_path import _PinPython, _thread_cpu_s
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hstu import Engine, HSTUPipelineStrategy, get_plan
from lightning_hstu.loops import epoch_loop
from lightning_hstu.loops.lightning_tasks import UNSHUFFLED, _passthrough


class Tiny(pl.LightningModule):
    """A step of a few tiny ops: forward, backward and an SGD step over four weights."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return (self.weight * x).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


class _Clock(pl.Callback):
    """The time, and each thread's CPU time, at the end of batch ``warmup - 1`` and of the last batch; the
    Python threads pinned at batch 50 with ``pin``."""

    def __init__(self, warmup: int, steps: int, pin: int | None):
        self.warmup, self.steps = warmup, steps
        self.pin = None if pin is None else _PinPython(pin)
        self.start = self.end = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == 50 and self.pin is not None:
            self.pin.pin()
        if batch_idx == self.warmup - 1:
            self.start = (time.perf_counter(), _thread_cpu_s())
        elif batch_idx == self.steps - 1:
            self.end = (time.perf_counter(), _thread_cpu_s())

    def per_step_us(self) -> tuple[float, dict[str, float]]:
        return per_step_us(self.start, self.end, self.steps - self.warmup - 1)


def per_step_us(start: tuple, end: tuple, steps: int) -> tuple[float, dict[str, float]]:
    """Wall us per step between two (time, each thread's CPU seconds) readings, and each thread's CPU us per
    step (the engine's threads by name; those under 1 us left out)."""
    (began, before), (ended, after) = start, end
    threads = {name: (s - before.get(name, 0.0)) * 1e6 / steps for name, s in after.items()}
    return (ended - began) * 1e6 / steps, {name: us for name, us in threads.items() if us >= 1.0}


def loader(steps: int, ranks: int = 1) -> DataLoader:
    """Batches of one sample, ``steps`` of them on each of ``ranks`` ranks (Lightning's sampler shares them)."""
    return DataLoader(TensorDataset(torch.randn(steps * ranks, 4)), batch_size=1)


def plain_us(steps: int, warmup: int) -> tuple[float, dict[str, float]]:
    model = Tiny()
    optimizer = model.configure_optimizers()
    start = None
    for index, batch in enumerate(loader(steps)):
        if index == warmup:
            start = (time.perf_counter(), _thread_cpu_s())
        optimizer.zero_grad()
        model.training_step(batch, index).backward()
        optimizer.step()
    return per_step_us(start, (time.perf_counter(), _thread_cpu_s()), steps - warmup)


def engine_us(steps: int, warmup: int, preset: str, step_timeout: float | None) -> tuple[float, dict[str, float]]:
    """The same step driven by ``Engine`` directly under ``preset``, without Lightning: zero_grad, forward,
    backward and optimizer_step as bodies of their own (what the user's path runs through Lightning's hooks,
    closure and precision plugin), the other tasks passing the batch through as they do for a plain module.
    The user's path minus this is the strategy's own cost."""
    model = Tiny()
    optimizer = model.configure_optimizers()
    own = {
        "zero_grad": lambda b: optimizer.zero_grad(),
        "forward": lambda b: b.__setitem__("loss", model.training_step(b["shuffled_batch"], b.index)),
        "backward": lambda b: b["loss"].backward(),
        "optimizer_step": lambda b: optimizer.step(),
    }

    copies = {**UNSHUFFLED, "device_batch": "batch"}  # h2d passes the host batch on: the step is on the CPU
    plan = get_plan(preset)
    bodies = {t.name: own[t.name] if t.name in own else _passthrough(t, copies) for t in plan.tasks}
    start = None
    with Engine(plan, bodies, step_timeout=step_timeout) as engine:
        for result in engine.steps(loader(steps)):
            if result.batch == warmup - 1:
                start = (time.perf_counter(), _thread_cpu_s())
        end = (time.perf_counter(), _thread_cpu_s())
    return per_step_us(start, end, steps - warmup)


def trainer_us(
    steps: int, warmup: int, strategy, pin: int | None = None, devices: int = 1
) -> tuple[float, dict[str, float]]:
    clock = _Clock(warmup, steps, pin)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[clock],
    )
    try:
        trainer.fit(Tiny(), loader(steps, devices))
    finally:
        if clock.pin is not None:
            clock.pin.release()  # the caller's thread back on its cores
    return clock.per_step_us()


def _every_hook(run):
    """``run`` with the epoch loop dispatching every per-batch hook through Lightning's dispatchers, as
    Lightning's loop does."""

    def every_hook():
        skipping = epoch_loop.skipping_idle_hooks
        epoch_loop.skipping_idle_hooks = contextlib.nullcontext
        try:
            return run()
        finally:
            epoch_loop.skipping_idle_hooks = skipping

    return every_hook


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--presets", nargs="+", default=["legacy_none", "default_d6"])
    parser.add_argument("--thread-cpu", action="store_true", help="each thread's CPU time per step (Linux)")
    parser.add_argument("--pin-python-threads", type=int, metavar="CORE", help="the Python threads on this core")
    parser.add_argument(
        "--pin-threads", type=int, metavar="CORE", help="also each preset with HSTUPipelineStrategy(pin_threads=CORE)"
    )
    parser.add_argument("--devices", type=int, default=1, help="gloo ranks (processes) per mode")
    parser.add_argument(
        "--every-hook",
        action="store_true",
        help="the user's path rows also with every per-batch hook dispatched through Lightning's dispatchers (without "
        "the epoch loop's own, loops/hook_calls.py)",
    )
    args = parser.parse_args()
    warnings.filterwarnings("ignore")  # Lightning's advice on workers and on the process group, every fit

    def fit(strategy):
        return lambda: trainer_us(args.steps, args.warmup, strategy(), args.pin_python_threads, args.devices)

    modes = {}
    if args.devices == 1:
        modes["plain loop"] = lambda: plain_us(args.steps, args.warmup)
        modes["Lightning's loop"] = fit(lambda: "auto")
    modes["Lightning's loop, DDP"] = fit(lambda: "ddp")  # what the strategy builds on (on one process: DDP over it)
    modes["user's path, engine=False"] = fit(lambda: HSTUPipelineStrategy(engine=False))
    for preset in args.presets:
        if args.devices == 1:
            modes[f"Engine, {preset}"] = lambda p=preset: engine_us(args.steps, args.warmup, p, 600.0)
            modes[f"Engine, {preset}, no timeout"] = lambda p=preset: engine_us(args.steps, args.warmup, p, None)
        modes[f"user's path, {preset}"] = fit(lambda p=preset: HSTUPipelineStrategy(p))
        modes[f"user's path, {preset}, no timeout"] = fit(lambda p=preset: HSTUPipelineStrategy(p, step_timeout=None))
        if args.every_hook:
            for timeout, suffix in ((600.0, ""), (None, ", no timeout")):
                strategy = lambda p=preset, t=timeout: HSTUPipelineStrategy(p, step_timeout=t)  # noqa: E731
                modes[f"user's path, {preset}{suffix}, every hook"] = _every_hook(fit(strategy))
        if args.pin_threads is not None:
            modes[f"user's path, {preset}, pin_threads={args.pin_threads}"] = fit(
                lambda p=preset: HSTUPipelineStrategy(p, pin_threads=args.pin_threads)
            )
    times = {mode: [] for mode in modes}
    threads = {mode: [] for mode in modes}
    for _ in range(args.repeats):
        for mode, run in modes.items():
            wall, per_thread = run()
            times[mode].append(wall)
            threads[mode].append(per_thread)
    if int(os.environ.get("LOCAL_RANK", 0)):
        return  # rank 0 prints
    pinned = f"; Python threads on core {args.pin_python_threads}" if args.pin_python_threads is not None else ""
    print(
        f"# {platform.processor() or 'cpu'}, {os.cpu_count()} cores, torch {torch.__version__}; {args.devices} "
        f"rank(s); {args.steps - args.warmup} timed steps, median of {args.repeats}{pinned}; "
        f"{time.strftime('%Y-%m-%d %H:%M')}"
    )
    base = "plain loop" if "plain loop" in times else "Lightning's loop, DDP"
    reference = statistics.median(times[base])
    print(
        f"{'mode':40} {'us/step':>9} {'spread':>8} {'over plain' if base == 'plain loop' else 'over DDP':>11}"
        + ("  CPU us/step per thread" if args.thread_cpu else "")
    )
    for mode, values in times.items():
        median = statistics.median(values)
        line = f"{mode:40} {median:9.1f} {max(values) - min(values):8.1f} {median - reference:+11.1f}"
        if args.thread_cpu:
            names = sorted(
                {n for t in threads[mode] for n in t},
                key=lambda n: -statistics.median(t.get(n, 0.0) for t in threads[mode]),
            )
            line += "  " + ", ".join(
                f"{n} {statistics.median(t.get(n, 0.0) for t in threads[mode]):.0f}" for n in names
            )
        print(line)


if __name__ == "__main__":
    main()
