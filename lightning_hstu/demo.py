"""A toy recommender workload that gives each of the fourteen tasks a small piece of real torch work on
the CPU, so that a preset can be run and timed before any Lightning or TorchRec is involved.

The bodies are stand-ins, named after what they stand for: the "shuffle" sorts samples by an
HSTU-like cost (length squared) instead of balancing them across ranks, "input dist" buckets item ids by
shard instead of an all-to-all, and "finalize grads" clips instead of all-reducing.
"""

import time
from dataclasses import dataclass

import torch
from torch import nn

from .engine import Engine, TaskRecord, format_summary, summarize
from .hstu.presets import get_plan
from .hstu.tasks import HSTU_TASK_NAMES
from .plan import Plan


@dataclass(frozen=True)
class ToyConfig:
    batch_size: int = 64
    max_len: int = 48
    num_items: int = 5000
    dim: int = 64
    shards: int = 4
    seed: int = 0


def toy_batches(config: ToyConfig, count: int) -> list[dict[str, torch.Tensor]]:
    """Item-id sequences with zipf-like lengths, reproducible from the seed."""
    gen = torch.Generator().manual_seed(config.seed)
    batches = []
    for _ in range(count):
        ranks = torch.randint(1, 1000, (config.batch_size,), generator=gen).float()
        lengths = (config.max_len / ranks.pow(0.5)).long().clamp(2, config.max_len)
        ids = torch.randint(0, config.num_items, (config.batch_size, config.max_len), generator=gen)
        mask = torch.arange(config.max_len) < lengths[:, None]
        batches.append(
            {
                "ids": ids * mask,
                "mask": mask,
                "lengths": lengths,
                "targets": torch.randint(0, 2, (config.batch_size,), generator=gen).float(),
            }
        )
    return batches


class ToyModel:
    """Embeddings plus a small MLP, with the body of each task as a method of the same name."""

    def __init__(self, config: ToyConfig):
        torch.manual_seed(config.seed)
        self.config = config
        self.embedding = nn.Embedding(config.num_items, config.dim)
        self.mlp = nn.Sequential(nn.Linear(config.dim, 4 * config.dim), nn.SiLU(), nn.Linear(4 * config.dim, 1))
        self.optimizer = torch.optim.SGD([*self.embedding.parameters(), *self.mlp.parameters()], lr=0.05)
        self.losses: list[float] = []

    def bodies(self):
        return {name: getattr(self, name) for name in HSTU_TASK_NAMES}

    def h2d(self, b):
        b["device_batch"] = {k: v.clone() for k, v in b["batch"].items()}  # a copy stands in for the transfer

    def start_shuffle(self, b):
        b["workloads"] = b["device_batch"]["lengths"].pow(2)  # HSTU attention cost grows with length^2

    def finish_shuffle(self, b):
        order = torch.argsort(b["workloads"], descending=True)
        b["shuffled_batch"] = {k: v[order] for k, v in b["device_batch"].items()}

    def start_input_dist(self, b):
        ids = b["shuffled_batch"]["ids"]
        counts = torch.bincount((ids % self.config.shards).flatten(), minlength=self.config.shards)
        b["input_dist_splits"] = {"ids": ids, "counts": counts}

    def wait_input_dist(self, b):
        splits = b["input_dist_splits"]
        b["sparse_input"] = {"ids": splits["ids"], "splits": splits["counts"].tolist()}

    def prefetch_embeddings(self, b):
        b["cache_prefetched"] = torch.unique(b["sparse_input"]["ids"])

    def zero_grad(self, b):
        self.optimizer.zero_grad(set_to_none=True)
        b["grads_cleared"] = True

    def global_tokens_allreduce(self, b):
        b["global_tokens"] = b["shuffled_batch"]["lengths"].sum()

    def compute_output_dist(self, b):
        b["embeddings"] = self.embedding(b["sparse_input"]["ids"])

    def forward(self, b):
        batch = b["shuffled_batch"]
        pooled = (b["embeddings"] * batch["mask"][..., None]).sum(1) / batch["lengths"][:, None]
        logits = self.mlp(pooled).squeeze(-1)
        loss = nn.functional.binary_cross_entropy_with_logits(logits, batch["targets"], reduction="sum")
        b["loss"] = loss * batch["lengths"].numel() / b["global_tokens"]

    def backward(self, b):
        b["loss"].backward()
        b["grads"] = True

    def finalize_model_grads(self, b):
        b["reduced_grads"] = nn.utils.clip_grad_norm_(self.mlp.parameters(), 1.0)

    def optimizer_step(self, b):
        self.optimizer.step()
        b["stepped"] = True

    def watchdog(self, b):
        loss = b["loss"].item()
        if loss != loss:
            raise FloatingPointError(f"loss is NaN at batch {b.index}")
        self.losses.append(loss)


def run_toy(plan: Plan, batches: list, config: ToyConfig) -> tuple[list[TaskRecord], float, ToyModel]:
    """Train the toy model once over ``batches`` under ``plan``; return records, seconds and the model."""
    model = ToyModel(config)
    with Engine(plan, model.bodies()) as engine:
        start = time.perf_counter()
        records = engine.run(batches)
        seconds = time.perf_counter() - start
    return records, seconds, model


def demo(plan: Plan, steps: int, config: ToyConfig = ToyConfig()) -> str:
    """Run the toy workload under ``plan`` and the sequential baseline; return a printable report."""
    batches = toy_batches(config, steps)
    run_toy(plan, batches[:8], config)  # warm-up: torch's first calls allocate and dispatch slowly
    base_records, base_s, base_model = run_toy(get_plan("legacy_none"), batches, config)
    records, seconds, model = run_toy(plan, batches, config)
    same = base_model.losses == model.losses
    lines = [
        plan.describe(),
        "",
        f"toy workload: {steps} batches of {config.batch_size} sequences (max length {config.max_len})",
        format_summary(summarize(records, [t.name for t in plan.tasks])),
        "",
        f"{plan.name}: {1e3 * seconds / steps:.3f} ms/step   legacy_none: {1e3 * base_s / steps:.3f} ms/step",
        f"losses identical to legacy_none: {same}   last loss: {model.losses[-1]:.4f}",
    ]
    return "\n".join(lines)
