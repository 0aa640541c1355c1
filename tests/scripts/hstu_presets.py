"""Trains the HSTU recommender on two ranks once per RUN, one after the other in the same processes; run by
test_two_gpus.py.

    python hstu_presets.py OUT_DIR STEPS RUN [RUN ...] [--accelerator {cpu,gpu}]

A RUN is a preset followed by options joined with "+", e.g. ``full_split_d6+graphs+delays``:

- ``delays``: random delays in the tasks, different on each rank (``LateOutputs``: on the host, and on a
  GPU also on the tasks' streams, with the ids handed to other streams written late);
- ``graphs``: capture_graphs=True with the padded attention (one static shape, captured after 3 steps);
- ``nowaits``: the engine's cross-stream CUDA event waits switched off (the host waits stay), to show that
  the delays make a missing wait change the weights;
- ``inputgroup``: the tables' input all-to-alls on a process group of their own (``input_dist_group="own"``).

After each run every rank saves its dense weights, its shards of the embedding tables and how the graphs
were used and the process group of each input all-to-all ("own", "world" or "other") to OUT_DIR/<RUN>.rank<R>.pt,
so that the runs before a failing one are still there.
"""

import argparse
import contextlib
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from lightning_hstu import PRESET_NAMES, HSTUPipelineStrategy
from lightning_hstu.engine.streams import CudaStreams
from lightning_hstu.models.hstu import HSTURecommender

sys.path.insert(0, str(Path(__file__).parents[1]))  # the tests' helpers
from delayed_hstu import LateOutputs  # noqa: E402

from lightning_runs import QUIET, end_rank_script  # noqa: E402
from small_hstu import model_and_data  # noqa: E402

OPTIONS = ("delays", "graphs", "nowaits", "inputgroup")


class GraphUse(Callback):
    def on_train_end(self, trainer, pl_module):
        graphed = pl_module.hstu_graphs()["forward"]
        self.use = {"eager_calls": graphed.eager_calls, "replays": graphed.replays, "graphs": len(graphed.graphs)}


def parse_run(run: str) -> tuple[str, set[str]]:
    preset, *options = run.split("+")
    if preset not in PRESET_NAMES:
        raise SystemExit(f"run {run!r}: unknown preset {preset!r}; valid presets: {', '.join(PRESET_NAMES)}")
    unknown = [o for o in options if o not in OPTIONS]
    if unknown:
        raise SystemExit(f"run {run!r}: unknown options {unknown}; valid options: {', '.join(OPTIONS)}")
    return preset, set(options)


@contextlib.contextmanager
def event_waits_off():
    wait = CudaStreams.wait
    CudaStreams.wait = lambda self, which, event: None
    try:
        yield
    finally:
        CudaStreams.wait = wait


def train(run: str, steps: int, accelerator: str, out_dir: str) -> None:
    preset, options = parse_run(run)
    model_kwargs, data = model_and_data(accelerator)
    pl.seed_everything(0, verbose=False)
    model_cls = LateOutputs if "delays" in options else HSTURecommender
    model = model_cls(
        **model_kwargs,
        attention="padded" if "graphs" in options else "auto",
        input_dist_group="own" if "inputgroup" in options else "world",
    )
    if "delays" in options:
        model.delay_seed = PRESET_NAMES.index(preset)  # a preset's runs with and without the waits: the same delays
    callbacks = [GraphUse()] if "graphs" in options else []
    trainer = pl.Trainer(
        strategy=HSTUPipelineStrategy(preset, capture_graphs="graphs" in options, step_timeout=120),
        accelerator=accelerator,
        devices=2,
        max_steps=steps,
        **QUIET,
        limit_val_batches=0,
        callbacks=callbacks,
    )
    with event_waits_off() if "nowaits" in options else contextlib.nullcontext():
        trainer.fit(model, data())
    torch.save(
        {
            "global_step": trainer.global_step,
            "dense": {k: v.detach().cpu() for k, v in model.objectives.state_dict().items()},
            "sparse": {k: v.detach().cpu() for k, v in model.embeddings.local_weights().items()},
            "graphs": callbacks[0].use if callbacks else None,
            "input_groups": [_which(group, model.embeddings.input_group) for group in model.embeddings.input_groups()],
        },
        f"{out_dir}/{run}.rank{trainer.global_rank}.pt",
    )


def _which(group, own) -> str:
    return "own" if own is not None and group is own else "world" if group is dist.group.WORLD else "other"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("steps", type=int)
    parser.add_argument("runs", nargs="+")
    parser.add_argument("--accelerator", choices=("cpu", "gpu"), default="cpu")
    args = parser.parse_args()
    for run in args.runs:
        parse_run(run)  # every name checked before the first run starts
    for run in args.runs:
        train(run, args.steps, args.accelerator, args.out_dir)


if __name__ == "__main__":
    main()
    end_rank_script()
