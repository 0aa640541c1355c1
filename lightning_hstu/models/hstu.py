"""The HSTU generative recommender as a LightningModule whose HSTU hooks are the engine's tasks.

Sparse: item, action and user tables in a TorchRec EmbeddingCollection sharded over every rank
(``hstu.sparse``), updated by a fused optimizer in backward. Dense: the HSTU stack and a ranking head,
data-parallel through megatron-core (``hstu.dense_grads``), stepped by the Lightning optimizer.

Objectives over every position of a history (the user token predicts the first item, item i the next):
retrieval, a sampled softmax of the next item against its sample's sampled negatives; ranking, the next
event's action from the hidden state and the next item's embedding. Both are summed over positions and
divided by the global token count (all ranks), so that the data-parallel mean of the rank losses is the
loss of the whole global batch.
"""

import functools
import importlib.util
import inspect
import math
import os
from typing import TYPE_CHECKING, Any, NamedTuple

import lightning.pytorch as pl
import torch
from torch import nn
from torch.nn import functional as F
from torchrec import EmbeddingConfig
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from ..checks import at_least, positive
from ..data.evaluation import held_items
from ..engine import SKIPPED, BatchView
from ..hstu.batch import HSTUBatch, check_table_sizes
from ..hstu.dense_grads import MegatronDenseGrads
from ..hstu.graphs import GraphedAdamW, GraphedMethod, token_capacity
from ..hstu.shuffler import BalancedShuffler, shuffle_group
from ..hstu.sparse import TABLES_AHEAD, ShardedEmbeddings, check_input_dist_group
from ..hstu.step import LOOKUP_KEYS, dense_losses, global_token_scale, global_tokens, sparse_features
from .hstu_layers import HSTUConfig, HSTUStack, Padding
from .ranking import RankingEvaluation

if TYPE_CHECKING:
    from ..loops import StepContext

RETRIEVAL_LOSSES = ("auto", "full", "sampled", "in_batch")
"""The retrieval loss, a softmax of each position's next item against negatives (cosine scores over a
temperature; a negative equal to the target is masked):

- ``full``: every item of the catalogue. Exact, and the best signal; per step it looks the whole item
  table up (N x D rows through TorchRec, plus their all-to-all with several ranks, one fused update) and
  scores every event against it (6 x events x N x D FLOPs forward and backward, an events x N logits
  tensor). The default up to ``FULL_SOFTMAX_MAX_ITEMS`` items.
- ``sampled``: the data module's ``negatives`` uniform item ids per sample, shared by the sample's
  positions (K lookups per sample, events x K scores). For catalogues too large for ``full``.
- ``in_batch``: the targets of every event of the (rank's) batch: C negatives per event, C the batch's
  events, drawn like item popularity (frequent items are pushed down more). No extra lookup; C x C scores,
  so keep batch x history length moderate. Unlike the other two, its loss depends on how the global batch
  is split over ranks.
- ``auto``: ``full`` up to ``FULL_SOFTMAX_MAX_ITEMS`` items, ``sampled`` above.
"""

FULL_SOFTMAX_MAX_ITEMS = 20_000
"""``auto`` picks the full softmax up to this many items (ML-100K: 1,682, ML-1M: 3,706; ML-20M's 26,744
get the sampled one): at 20,000 items and width 64, a batch of 4,000 events costs 10 GFLOP forward for
the scores and an 80M-entry logits tensor (320 MB in fp32), about what the HSTU layers themselves cost."""


def resolve_retrieval(choice: str, num_items: int | None) -> str:
    """``choice`` with ``auto`` resolved by the catalogue size (``sampled`` while it is unknown)."""
    if choice not in RETRIEVAL_LOSSES:
        raise ValueError(f"unknown retrieval_loss {choice!r}; valid: {', '.join(RETRIEVAL_LOSSES)}")
    if choice != "auto":
        return choice
    return "full" if num_items is not None and num_items <= FULL_SOFTMAX_MAX_ITEMS else "sampled"


NONFINITE = ("raise", "skip", "stop")
"""``on_nonfinite_loss``: raise and skip agree on every rank's loss before backward (the compute thread waits
for the forward on the GPU), so a non-finite loss is never applied, then end training or go on; stop checks
in the watchdog task, after the step was queued without waiting, and ends training with the step applied."""
ATTENTION = ("auto", "fused", "grouped", "padded")
"""How the HSTU layers attend: ``fused``, the jagged Triton kernel (no padding anywhere in the dense part);
``grouped``, the jagged layout with attention in plain PyTorch over groups of histories of like lengths,
each padded to its longest (``GroupedTokens``: the reference's arithmetic on fewer tokens; it reads the
lengths on the host, so it is for the CPU and cannot be captured in a CUDA graph); ``padded``, the
plain-PyTorch reference over histories padded to the batch's longest; ``auto``, fused on CUDA (padded
without Triton), grouped elsewhere."""

SPARSE_OPTIMIZERS = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad, "adam": torch.optim.Adam}
"""Optimizers TorchRec fuses into the embedding backward."""
LR_SCHEDULES = ("constant", "cosine")
"""The dense learning rate over the fit: ``constant``, ``lr`` throughout; ``cosine``, from ``lr`` down to 0
along half a cosine over the fit's optimizer steps (``Trainer.estimated_stepping_batches``), set every step.
The tables' fused optimizer keeps ``sparse_lr``."""


class HSTURecommender(RankingEvaluation, pl.LightningModule):
    """HSTU over user histories. The training recipe's arguments: ``retrieval_loss`` (``RETRIEVAL_LOSSES``)
    and ``temperature``; ``ranking_weight``, the next-action loss's weight (0 drops it and its head);
    ``position_embedding``, ``scale_inputs`` and ``input_dropout`` (``HSTUConfig``); ``history_logit``, a
    learned logit for the items already in the history (``HSTUObjectives``); AdamW's ``lr``,
    ``weight_decay`` and ``betas`` and the ``lr_schedule`` (``LR_SCHEDULES``) for the dense part,
    ``sparse_optimizer`` and ``sparse_lr`` for the tables. Speed: ``input_dist_group`` (``INPUT_DIST_GROUPS``:
    the tables' input all-to-alls on the step's process group, or on one of their own), ``attention``
    (``ATTENTION``), ``compile_layers`` (``HSTUConfig``: the layers' token-wise parts through ``torch.compile``
    where the fused attention runs on CUDA) and ``autocast_residual`` (``HSTUConfig``: under autocast the
    residual stream in its dtype; False keeps it in float32). Evaluated by ``RankingEvaluation``."""

    def __init__(
        self,
        embedding_dim: int = 64,
        num_layers: int = 2,
        num_heads: int = 2,
        attention_dim: int = 32,
        hidden_dim: int = 32,
        max_seq_len: int = 200,
        dropout: float = 0.1,
        temperature: float = 0.05,
        lr: float = 1e-3,
        sparse_lr: float = 0.05,
        sparse_optimizer: str = "adagrad",
        balance_batches: bool = True,
        input_dist_group: str = "world",
        on_nonfinite_loss: str = "raise",
        cache_load_factor: float | None = None,
        num_items: int | None = None,
        num_users: int | None = None,
        num_actions: int | None = None,
        attention: str = "auto",
        retrieval_loss: str = "auto",
        ranking_weight: float = 1.0,
        position_embedding: bool = False,
        scale_inputs: bool = False,
        input_dropout: float = 0.0,
        weight_decay: float = 0.01,
        betas: tuple[float, float] = (0.9, 0.999),
        compile_layers: bool = False,
        autocast_residual: bool = True,
        history_logit: bool = False,
        lr_schedule: str = "constant",
    ):
        super().__init__()
        if attention not in ATTENTION:
            raise ValueError(f"unknown attention {attention!r}; valid: {', '.join(ATTENTION)}")
        if sparse_optimizer not in SPARSE_OPTIMIZERS:
            raise ValueError(f"unknown sparse_optimizer {sparse_optimizer!r}; valid: {', '.join(SPARSE_OPTIMIZERS)}")
        if lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"unknown lr_schedule {lr_schedule!r}; valid: {', '.join(LR_SCHEDULES)}")
        check_input_dist_group(input_dist_group)
        if on_nonfinite_loss not in NONFINITE:
            raise ValueError(f"unknown on_nonfinite_loss {on_nonfinite_loss!r}; valid: {', '.join(NONFINITE)}")
        if ranking_weight < 0:
            raise ValueError(f"ranking_weight must be at least 0 (0 turns the ranking loss off), got {ranking_weight}")
        at_least(1, embedding_dim=embedding_dim, num_layers=num_layers, num_heads=num_heads)
        at_least(1, attention_dim=attention_dim, hidden_dim=hidden_dim, max_seq_len=max_seq_len)
        at_least(1, num_items=num_items, num_users=num_users, num_actions=num_actions)  # None: from the data
        at_least(0, lr=lr, sparse_lr=sparse_lr, weight_decay=weight_decay, dropout=dropout, input_dropout=input_dropout)
        positive(temperature=temperature)
        self.save_hyperparameters()
        config = HSTUConfig(
            embedding_dim,
            num_layers,
            num_heads,
            attention_dim,
            hidden_dim,
            max_seq_len + 1,
            dropout=dropout,
            position_embedding=position_embedding,
            scale_inputs=scale_inputs,
            input_dropout=input_dropout,
            compile_layers=compile_layers,
            autocast_residual=autocast_residual,
        )
        self.num_items = num_items
        self.objectives = HSTUObjectives(
            config,
            num_actions or 5,
            temperature,
            attention,
            resolve_retrieval(retrieval_loss, num_items),
            ranking_weight,
            history_logit,
        )
        self.objectives.catalogue = num_items + 1 if num_items else None
        self.embeddings: ShardedEmbeddings | None = None
        self.balance_totals = [0.0, 0.0, 0]
        """Sums of the shuffler's max/mean rank cost before and after, and the number of global batches."""
        self.skipped_batches: list[tuple[int, int]] = []
        """(epoch, batch index) of each batch whose step was skipped because a rank's loss was not finite."""
        self._nonfinite: set[int] = set()
        self._last_finite: tuple[int, int] | None = None
        """(epoch, batch) of the latest finite loss under "raise" and "skip"."""
        self._finite_flags: dict[int, torch.Tensor] = {}
        """``on_nonfinite_loss="stop"``: each step's finite flag, on the device, until the watchdog reads it."""
        self._graphed: GraphedMethod | None = None
        self._unpipelined_batch: int | None = None  # set while Lightning's own loop trains a batch
        self._last_batch: HSTUBatch | None = None
        self._tables_ahead: tuple[int, int] | None = None
        """(epoch, batch) whose update the tables' fused optimizer applied in backward while the dense optimizer
        step of that batch has not run yet."""

    # ----- built once the process group exists ------------------------------------------------------

    def configure_model(self) -> None:
        if self.embeddings is not None:
            return
        if self.trainer.state.fn == "fit" and getattr(self.trainer.precision_plugin, "scaler", None) is not None:
            raise ValueError(
                f"precision={self.trainer.precision!r} scales the loss with a GradScaler, but the embedding "
                f"tables' fused optimizer applies their gradients inside backward, before any unscaling: "
                f"use precision='bf16-mixed' or '32-true'"
            )
        data = self.trainer.datamodule
        hp = self.hparams
        num_items, num_users = hp.num_items or data.num_items, hp.num_users or data.num_users
        check_table_sizes(
            dict(num_items=num_items, num_users=num_users, num_actions=hp.num_actions or data.num_actions),
            dict(num_items=data.num_items, num_users=data.num_users, num_actions=data.num_actions),
        )
        head = self.objectives.ranking_head
        if head is not None and head[-1].out_features < data.num_actions:
            raise ValueError(
                f"the data's actions go up to {data.num_actions - 1} ({data.num_actions} classes), but the ranking "
                f"head predicts {head[-1].out_features} (num_actions={hp.num_actions}; unset means 5): set "
                f"num_actions={data.num_actions}, or ranking_weight=0 to train without the ranking loss"
            )
        self.num_items = num_items
        self.objectives.retrieval = resolve_retrieval(hp.retrieval_loss, num_items)
        self.objectives.catalogue = num_items + 1
        device = self.trainer.strategy.root_device
        if self.objectives.fused(device):
            self._check_length("the fused attention kernel sizes its grid by")
        timeout = getattr(self.trainer.strategy, "process_group_timeout", None)
        self.embeddings = ShardedEmbeddings(
            embedding_tables(hp.embedding_dim, num_items, num_users, hp.num_actions or data.num_actions),
            device,
            optimizer=SPARSE_OPTIMIZERS[hp.sparse_optimizer],
            optimizer_kwargs={"lr": hp.sparse_lr},
            cache_load_factor=hp.cache_load_factor,
            input_dist_group=hp.input_dist_group,
            timeout=timeout,
        )
        self.dense_grads = MegatronDenseGrads(self.objectives.to(device), timeout=timeout)
        self.shuffler = BalancedShuffler(
            self.trainer.datamodule.batch_size,
            group=shuffle_group(hp.balance_batches, timeout),
            enabled=hp.balance_batches,
            sizes_group=shuffle_group(hp.balance_batches, timeout, backend="gloo"),
        )

    def configure_optimizers(self):
        # the sparse tables have their own (fused) optimizer; the dense one is captured with the graphs
        hp = self.hparams
        plan = getattr(self.trainer.strategy, "plan", None)
        graphed = plan is not None and "optimizer_step" in plan.capturable and self.device.type == "cuda"
        optimizer = dense_adamw(
            self.objectives.parameters(), graphed, lr=hp.lr, weight_decay=hp.weight_decay, betas=tuple(hp.betas)
        )
        if hp.lr_schedule == "constant":
            return optimizer
        steps = max(int(self.trainer.estimated_stepping_batches), 1)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
        self.dense_grads.zero_grad()

    # ----- the engine's tasks -------------------------------------------------------------------------

    def hstu_start_shuffle(self, b: BatchView) -> None:
        b["workloads"] = self.shuffler.start(b["device_batch"])

    def hstu_finish_shuffle(self, b: BatchView) -> None:
        b["shuffled_batch"] = self.shuffler.finish(b["workloads"])
        balance, totals = self.shuffler.last_balance, self.balance_totals
        totals[0], totals[1], totals[2] = totals[0] + balance.before, totals[1] + balance.after, totals[2] + 1

    def hstu_start_input_dist(self, b: BatchView) -> None:
        b["input_dist_splits"] = self.embeddings.start_input_dist(self.sparse_features(b["shuffled_batch"]))

    def hstu_wait_input_dist(self, b: BatchView) -> None:
        b["sparse_input"] = self.embeddings.wait_input_dist(b["input_dist_splits"])

    def hstu_prefetch_embeddings(self, b: BatchView):
        if not self.embeddings.needs_prefetch:
            b["cache_prefetched"] = None
            return SKIPPED  # no table uses an embedding cache
        forward_stream = self.trainer.strategy.task_stream("compute_output_dist")  # where the lookup runs
        self.embeddings.prefetch(b["sparse_input"], forward_stream)
        b["cache_prefetched"] = True

    def hstu_global_tokens_allreduce(self, b: BatchView) -> None:
        b["global_tokens"] = global_tokens(b["shuffled_batch"])

    def hstu_compute_output_dist(self, b: BatchView) -> None:
        b["embeddings"] = self.embeddings.compute_output_dist(b["sparse_input"])

    def hstu_finalize_model_grads(self, b: BatchView) -> None:
        self._finalize_grads(b.index)  # under the strategy, only at optimizer steps (not inside accumulation)
        b["reduced_grads"] = True

    def hstu_watchdog(self, b: BatchView) -> None:
        self._watch(b.index)

    def hstu_graphs(self) -> dict[str, "GraphedMethod | GraphedAdamW"]:
        """What the engine captures when the plan marks forward capturable: the dense losses on inputs of
        static shapes: padded to the model's length (``HSTUObjectives.dense_inputs(static=True)``), or
        jagged, grown to the token count rounded up to a capacity (``HSTUObjectives.graph_growth``; one graph
        per capacity, up to ``JAGGED_GRAPHS``); and the dense optimizer's step where it is a ``GraphedAdamW``
        (``configure_optimizers`` on a GPU)."""
        if self._graphed is None:
            self._check_length("graph capture pads histories to")
            device = self.trainer.strategy.root_device
            layout = self.objectives.layout(device)
            if layout == "grouped" and device.type == "cuda":  # a CPU never captures: the calls run eagerly
                raise ValueError(
                    "attention='grouped' groups the histories by their lengths, read on the host at every step, "
                    "which a CUDA graph cannot capture: with capture_graphs use attention='fused' or 'padded'"
                )
            self._graphed = GraphedMethod(
                self.objectives,
                "losses",
                max_graphs=JAGGED_GRAPHS if layout != "padded" else 2,  # a few capacities; padding has one shape
                accumulators=self.dense_grads.accumulators(),
            )
        graphs = {"forward": self._graphed}
        optimizer = self.trainer.optimizers[0] if self.trainer.optimizers else None
        if isinstance(optimizer, GraphedAdamW):
            graphs["optimizer_step"] = optimizer
        return graphs

    def _check_length(self, what: str) -> None:
        data_length = getattr(self.trainer.datamodule, "max_seq_len", None) if self._trainer else None
        if data_length is not None and data_length > self.objectives.max_events:
            raise ValueError(
                f"{what} the model's max_seq_len ({self.objectives.max_events}), but the data "
                f"module's histories reach max_seq_len={data_length}: make them equal"
            )

    def _finalize_grads(self, index: int) -> None:
        self.dense_grads.finalize()
        if index in self._nonfinite and not self._finite_in_window(index):
            for p in self.objectives.parameters():
                p.grad = None  # no dense step either: the optimizer skips parameters without gradients

    def _finite_in_window(self, index: int) -> bool:
        """Whether a batch before ``index`` in the accumulation window that ``index`` ends had a finite loss: its
        gradients are in the window's sum (a non-finite batch's are an exact zero), so the dense step applies
        them, as it does when the non-finite batch is not the window's last."""
        if self._last_finite is None:
            return False
        epoch, batch = self._last_finite
        first = index - index % self.trainer.accumulate_grad_batches  # Lightning's windows start at these batches
        return epoch == self.current_epoch and first <= batch < index

    def _watch(self, index: int) -> None:
        flag = self._finite_flags.pop(index, None)
        if flag is not None:  # "stop": read now, after the step's backward and optimizer step were queued
            strategy = self.trainer.strategy
            agree = getattr(strategy, "all_ranks", strategy.reduce_boolean_decision)
            if not agree(bool(flag)):  # waits for this step's loss only
                raise FloatingPointError(
                    f"non-finite loss at batch {index} (on at least one rank); the step was "
                    f"applied (on_nonfinite_loss='stop'): this process's weights are not "
                    f"finite, resume from a checkpoint"
                )
        if index not in self._nonfinite:
            return
        self._nonfinite.discard(index)
        if self.hparams.on_nonfinite_loss == "raise":
            raise FloatingPointError(
                f"non-finite loss at batch {index} (on at least one rank); the step was not applied"
            )
        self.skipped_batches.append((self.current_epoch, index))

    # ----- under Lightning's own loop (HSTUPipelineStrategy(engine=False)): the same step, unpipelined --

    def on_after_backward(self) -> None:
        # Right after backward, as the engine's finalize task: Lightning's GradScaler unscaling and the
        # callbacks' on_before_optimizer_step run before this module's hook and must see the gradients.
        accumulating = self.trainer.fit_loop.epoch_loop._should_accumulate()
        if self._unpipelined_batch is not None and not accumulating:
            self._finalize_grads(self._unpipelined_batch)
        if accumulating:  # no dense step for this batch: its update is whole
            self._tables_ahead = None

    # ----- the tables' update is applied inside backward, the dense one at the optimizer step ----------

    def on_before_backward(self, loss: torch.Tensor) -> None:
        self._tables_ahead = (self.current_epoch, self.trainer.fit_loop.epoch_loop.batch_idx)

    def optimizer_step(self, *args, **kwargs) -> None:
        super().optimizer_step(*args, **kwargs)
        self._tables_ahead = None

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        if self._unpipelined_batch is not None:
            self._unpipelined_batch = None
            self._watch(batch_idx)

    # ----- checkpoints ---------------------------------------------------------------------------------

    ARCHITECTURE = (
        "embedding_dim",
        "num_layers",
        "num_heads",
        "attention_dim",
        "hidden_dim",
        "max_seq_len",
        "position_embedding",
        "scale_inputs",
        "history_logit",
    )
    """Hyper-parameters that decide what the weights mean: a checkpoint's must equal the running model's (table
    sizes may be None, from the data: DCP's size check covers them)."""

    def checkpoint_mismatch(self, saved: dict[str, Any]) -> list[str]:
        """The ``ARCHITECTURE`` hyper-parameters in which a checkpoint's (``saved``) differ from this model's,
        each named with both values (empty: the weights mean the same here). One the checkpoint does not
        record (saved before the argument existed) counts as the argument's default; a checkpoint without
        hyper-parameters is not checked."""
        if not saved:
            return []
        defaults = {p.name: p.default for p in inspect.signature(HSTURecommender.__init__).parameters.values()}
        saved = {name: saved.get(name, defaults.get(name)) for name in self.ARCHITECTURE}
        return [
            f"{name}={saved[name]!r} in the checkpoint, {self.hparams[name]!r} here"
            for name in self.ARCHITECTURE
            if name in self.hparams and saved[name] != self.hparams[name]
        ]

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        # The fused sparse optimizer is not a Lightning optimizer: its state (sharded, like the tables)
        # travels in an entry of its own, which the strategy writes through torch.distributed.checkpoint.
        checkpoint["sparse_optimizer"] = self.embeddings.model_parallel.fused_optimizer.state_dict()
        if self._tables_ahead is not None:  # a save after a step failed between backward and the dense step
            checkpoint[TABLES_AHEAD] = list(self._tables_ahead)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        # Through the strategy, DCP has already filled the live state in place; this also loads a
        # checkpoint dict that was read some other way.
        if "sparse_optimizer" in checkpoint:
            self.embeddings.model_parallel.fused_optimizer.load_state_dict(checkpoint["sparse_optimizer"])

    def on_fit_end(self) -> None:
        before, after, batches = self.balance_totals
        if batches and self.trainer.is_global_zero and self.shuffler.active:
            print(
                f"\nbalanced shuffler: max/mean rank cost {before / batches:.3f} -> {after / batches:.3f} "
                f"(mean over {batches} global batches)"
            )

    # ----- training and evaluation --------------------------------------------------------------------

    @property
    def flops_per_batch(self) -> int | None:
        """Model FLOPs of the last trained batch (``HSTUObjectives.training_flops``): what Lightning's
        ``ThroughputMonitor`` reads to report MFU. Reading it waits for that batch's lengths on the host. None
        outside training (validation, test, predict: no training step's FLOPs to report there)."""
        if self._last_batch is None or (self._trainer is not None and not self.trainer.training):
            return None
        batch = self._last_batch
        lengths = batch.sequence_lengths().tolist()
        rows = (
            self.num_items + 1 if self.objectives.retrieval == "full" else batch.features["item_neg"].values().numel()
        )
        negatives = self.objectives.negatives_per_event(batch.size, sum(lengths), rows)
        return self.objectives.training_flops(lengths, negatives)

    def training_step(self, batch: HSTUBatch, batch_idx: int):
        self._last_batch = batch  # for flops_per_batch (read only if asked: it waits for the lengths)
        step = getattr(self.trainer.strategy, "step_context", None)  # None under Lightning's own loop
        embeddings, tokens, graphed = self._step_inputs(batch, batch_idx, step)
        retrieval, ranking = dense_losses(self.objectives, batch, embeddings, graphed)
        scale = global_token_scale(tokens)
        loss = self._checked((retrieval + ranking) * scale, batch_idx, embeddings, step)
        self._log_step(batch.size, loss, retrieval, ranking, scale)
        return loss

    def _step_inputs(
        self, batch: HSTUBatch, batch_idx: int, step: "StepContext | None"
    ) -> tuple[dict, torch.Tensor, GraphedMethod | None]:
        """The batch's embeddings, the global token count and the graphs to run the dense part through (None:
        eager). Under the engine its tasks produced the first two; under Lightning's own loop they are
        computed here, in order (and the batch is not shuffled across ranks)."""
        if step is not None:
            graphed = self.hstu_graphs()["forward"] if step.captured else None
            return step.slots["embeddings"], step.slots["global_tokens"], graphed
        self._unpipelined_batch = batch_idx
        return self.embeddings(self.sparse_features(batch)), global_tokens(batch), None

    def _checked(
        self, loss: torch.Tensor, batch_idx: int, embeddings: dict, step: "StepContext | None"
    ) -> torch.Tensor:
        """``on_nonfinite_loss``: "stop" keeps the finite flag for the watchdog task (no wait here); "raise" and
        "skip" agree on it across ranks before backward, waiting for the forward on the GPU, and turn a
        non-finite loss into an exact zero: every rank must still run backward (its all-to-alls and
        all-reduces are collectives), and no non-finite gradient may reach the fused embedding update."""
        if self.hparams.on_nonfinite_loss == "stop":
            self._finite_flags[batch_idx] = torch.isfinite(loss.detach())
            return loss
        finite = bool(torch.isfinite(loss))
        if step.all_ranks(finite) if step is not None else self.trainer.strategy.reduce_boolean_decision(finite):
            self._last_finite = (self.current_epoch, batch_idx)
            return loss
        self._nonfinite.add(batch_idx)
        zero = sum(p.sum() for p in self.objectives.parameters()) * 0.0
        zero = zero + sum(jt.values().sum() for jt in embeddings.values()) * 0.0
        return zero.nan_to_num(0.0, 0.0, 0.0)  # non-finite embeddings times 0 are NaN: zero, and zero gradients

    def _log_step(
        self, batch_size: int, loss: torch.Tensor, retrieval: torch.Tensor, ranking: torch.Tensor, scale: torch.Tensor
    ) -> None:
        """The loss, its two parts (each times the loss's ``scale``) and the shuffler's balance at the steps where
        Lightning writes metrics to the logger (every ``Trainer(log_every_n_steps)``), and nowhere else: each
        ``self.log`` costs the compute thread's host about as much as launching a small layer (Lightning moves
        the stored result to the value's device and rebuilds its metadata on every call), and the scaled parts
        are two kernels that only a logged step needs. The progress bar and callbacks that monitor
        ``train/loss`` see the value of the last logged step; ``log_every_n_steps=1`` logs each."""
        trainer = self.trainer
        if trainer.log_every_n_steps > 0 and (trainer.global_step + 1) % trainer.log_every_n_steps == 0:
            self.log("train/loss", loss, prog_bar=True, batch_size=batch_size)
            with torch.no_grad():
                parts = {"train/retrieval": retrieval * scale, "train/ranking": ranking * scale}
            self.log_dict(parts, batch_size=batch_size)
            if self.shuffler.last_balance is not None:
                self.log("shuffle/max_over_mean", self.shuffler.last_balance.after, batch_size=batch_size)

    def sparse_features(self, batch: HSTUBatch) -> KeyedJaggedTensor:
        """The features the tables look up for ``batch``; with the full softmax, ``item_neg`` holds the whole
        item table instead of sampled ids (on the first sample; one lookup per step, so that the fused
        optimizer sees each row's gradient once, whatever features it came through)."""
        features = sparse_features(batch)
        return with_catalogue(features, self.num_items + 1) if self.objectives.retrieval == "full" else features

    def score_items(self, batch: HSTUBatch) -> torch.Tensor:
        """[B, num_items + 1] cosine scores of every item for the next event of each history, in fp32 under
        any precision (under bf16 autocast the product rounded them to steps of 2^-8 near 1, and the items
        tied with the held-out one counted above it: lower metrics for the same weights)."""
        last = self.objectives.last_states(batch, self.embeddings(sparse_features(batch)))
        with torch.autocast(last.device.type, enabled=False):
            scores = F.normalize(last.float(), dim=-1) @ F.normalize(self.all_item_embeddings().float(), dim=-1).T
        return self.objectives.with_history_logit(scores, batch.features["item"])

    def evaluation_weights(self) -> list[torch.Tensor]:
        """The dense parameters and this rank's table shards: copying into them restores the model."""
        return [*self.objectives.parameters(), *self.embeddings.local_weights().values()]

    def all_item_embeddings(self) -> torch.Tensor:
        """Every item's embedding [num_items + 1, D], looked up through the sharded tables."""
        ids = torch.arange(self.num_items + 1, device=self.device)
        none = torch.zeros_like(ids)
        features = KeyedJaggedTensor.from_lengths_sync(  # one id per row under "item", nothing elsewhere
            keys=["item", "item_neg", "action", "user"],
            values=ids,
            lengths=torch.cat([torch.ones_like(ids), none, none, none]),
        )
        return self.embeddings(features)["item"].values()


class DenseInputs(NamedTuple):
    """The dense part's inputs, padded to a length: what a CUDA graph of the padded dense part takes
    (static shapes for a fixed batch size and length). The first four carry gradients back to the
    embeddings."""

    events: torch.Tensor
    """[B, L, D] item + action embeddings of each history."""
    targets: torch.Tensor
    """[B, L, D] item embeddings (each position's next-item target)."""
    user: torch.Tensor
    """[B, D] the user token, before the events."""
    negatives: torch.Tensor
    """The retrieval loss's negatives: ``sampled``, [B, K, D] each sample's; ``full``, [N + 1, D] the
    whole item table (row 0, no item, is masked); ``in_batch``, [0, D] (the targets are the negatives)."""
    times: torch.Tensor
    """[B, L] event timestamps."""
    actions: torch.Tensor
    """[B, L] event actions (the ranking targets)."""
    target_ids: torch.Tensor
    """[B, L] the targets' item ids (0 at padding): a negative with the target's id is masked."""
    negative_ids: torch.Tensor
    """The negatives' item ids: [B, K], [N + 1] or [0], as ``negatives``."""
    mask: torch.Tensor
    """[B, L] True at real events."""


class JaggedInputs(NamedTuple):
    """The same inputs with every history's events back to back (no padding): ``C`` event rows, the
    first ``lengths.sum()`` real. In a CUDA graph ``C`` is a capacity (``token_capacity``) and the rows
    past the real ones are zero (``HSTUObjectives.graph_growth``): the shapes then depend on the batch size
    and the capacity only."""

    events: torch.Tensor
    """[C, D] item + action embeddings."""
    targets: torch.Tensor
    """[C, D] item embeddings."""
    user: torch.Tensor
    """[B, D]"""
    negatives: torch.Tensor
    """As ``DenseInputs.negatives``."""
    times: torch.Tensor
    """[C] event timestamps."""
    actions: torch.Tensor
    """[C] event actions."""
    target_ids: torch.Tensor
    """[C] the targets' item ids (0 past the real rows)."""
    negative_ids: torch.Tensor
    """As ``DenseInputs.negative_ids``."""
    lengths: torch.Tensor
    """[B] events per history."""


GROWN = tuple(JaggedInputs._fields.index(f) for f in ("events", "targets", "times", "actions", "target_ids"))
"""The token-wise ``JaggedInputs``: grown to a token capacity in a CUDA graph."""

JAGGED_GRAPHS = 96
"""Graphs of the jagged dense part, one per token capacity (``token_capacity``: thirty-two per power of two): 96
cover batches whose event counts span three octaves. With 6, a seventh capacity of the light benchmark's
batches (H200, 2026-12-01) ran eagerly at every one of its batches, at about twice a replayed step's time."""


class _TokenRows(torch.autograd.Function):
    """``user`` and ``events`` rows put at the token rows ``user_rows`` and ``event_rows``, which together
    name every row of the output once (``JaggedLayout``). Forward writes each row once into an empty tensor
    (no fill, no copy of a whole zero tensor per source, as out-of-place ``index_copy`` makes); backward
    gathers each source's gradient rows (no zeroing of the rows a source filled, which autograd's
    ``index_copy`` does for the tensor it wrote into)."""

    @staticmethod
    def forward(ctx, user, events, user_rows, event_rows):
        ctx.save_for_backward(user_rows, event_rows)
        rows = events.new_empty((len(user_rows) + len(event_rows), *events.shape[1:]))
        return rows.index_copy_(0, user_rows, user).index_copy_(0, event_rows, events)

    @staticmethod
    def backward(ctx, grad):
        user_rows, event_rows = ctx.saved_tensors
        user = grad.index_select(0, user_rows) if ctx.needs_input_grad[0] else None
        events = grad.index_select(0, event_rows) if ctx.needs_input_grad[1] else None
        return user, events, None, None


class JaggedLayout:
    """Where every history's tokens go in the stack's jagged input: sample b's are its user token, then its
    events, and the samples follow each other; event rows past the real ones (a capacity) come last, in no
    sequence. Computed on the device from the lengths: no host sync."""

    def __init__(self, lengths: torch.Tensor, capacity: int):
        batch, device = len(lengths), lengths.device
        ends = torch.cumsum(lengths, 0)
        self.event_offsets = F.pad(ends, (1, 0))
        self.token_offsets = self.event_offsets + torch.arange(batch + 1, device=device)
        event = torch.arange(capacity, device=device)
        self.sample = torch.searchsorted(ends, event, right=True)  # ``batch`` for rows past the real ones
        self.real = self.sample < batch
        self.event_token = event + self.sample + self.real  # past the user tokens up to its own
        self.size = capacity + batch

    def tokens(self, user: torch.Tensor, events: torch.Tensor) -> torch.Tensor:
        """The ``size`` token rows: ``user`` [B, ...] at each history's first token, ``events`` [capacity, ...]
        at theirs (``_TokenRows``: the two sets of rows cover every token once)."""
        return _TokenRows.apply(user, events, self.token_offsets[:-1], self.event_token)

    def user_times(self, times: torch.Tensor) -> torch.Tensor:
        """The user token's time: its history's first event's (0 for an empty history), as padding gives."""
        first = self.event_offsets[:-1].clamp(max=max(len(times) - 1, 0))
        return torch.where(self.event_offsets[1:] > self.event_offsets[:-1], times[first], 0)


HISTORY_TABLE_ENTRIES = 1 << 24
"""Entries of the largest [batch, width] table that ``HistoryItems`` fills (int32: 64 MiB); a larger batch
times catalogue is sorted instead."""


class HistoryItems:
    """Which items each history holds before each of its positions, for the history logit, built on the
    device from the target ids (no host sync, fixed shapes, so it can be captured). Position j of a history
    predicts its event j, having read events 0 .. j - 1: it holds an item whose first position is below j.
    ``sample``, ``position`` and ``real`` (False at padding and at rows past the real ones) are per target,
    in the layout's shape, positions below its last dimension; ``sample`` and ``position`` are also the
    coordinates of the queries that predict those targets.

    Two representations answer the same: while ``batch * width`` is at most ``HISTORY_TABLE_ENTRIES``
    (2**24), a [batch, width] table of every history's first position of every item, one gather per query;
    beyond it (sampled or in-batch negatives over millions of items, where the table would be gigabytes
    filled every step), the targets sorted by (sample, item, position), one binary search per query, memory
    in the targets only. ``table=True`` keeps the table whatever its size: a full softmax's queries cover
    every column, which the table answers with less memory and time than a search."""

    NEVER = torch.iinfo(torch.int32).max

    def __init__(self, target_ids, sample, position, real, batch: int, width: int, table: bool | None = None):
        self.sample, self.position, self.width = sample, position, width
        self._targets = (target_ids, real)
        self.dense = batch * width <= HISTORY_TABLE_ENTRIES if table is None else table
        """Whether the table (else the sorted targets) answers ``holds``."""
        if self.dense:
            first = torch.full((batch * width,), self.NEVER, dtype=torch.int32, device=target_ids.device)
            at = torch.where(real, position, self.NEVER).to(torch.int32)
            index = (sample * width + target_ids).flatten()
            self.first = first.scatter_reduce(0, index, at.flatten(), reduce="amin").view(batch, width)
        else:
            self.keys, self.first_position = self._sorted(target_ids, sample, position, real, batch, width)

    @classmethod
    def padded(cls, target_ids, real, width: int, table: bool | None = None) -> "HistoryItems":
        """For the padded [B, L] layout: target (b, j) is event j of history b (``real`` where it exists), and
        its query is at (b, j)."""
        batch, length = real.shape
        sample = torch.arange(batch, device=real.device)[:, None].expand(batch, length)
        position = torch.arange(length, device=real.device)[None, :].expand(batch, length)
        return cls(target_ids, sample, position, real, batch, width, table)

    @staticmethod
    def _sorted(target_ids, sample, position, real, batch: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys sample * width + item, ascending (``batch * width`` past the real targets: above every
        query), and the positions; at each key's first occurrence, its smallest position."""
        span = position.shape[-1] + 1  # above every position of the layout
        never = batch * width
        if (never + 1) * span > torch.iinfo(torch.int64).max:
            raise ValueError(
                f"HistoryItems sorts (sample * width + item) * {span} + position in int64: batch={batch} "
                f"times width={width} times {span} positions overflows it"
            )
        key = torch.where(real, sample.long() * width + target_ids.long(), never)
        composite = (key * span + torch.where(real, position.long(), 0)).flatten()
        composite = torch.cat([composite, composite.new_full((1,), never * span)])  # never empty
        ordered = torch.sort(composite).values
        return ordered // span, ordered % span

    def catalogue_pairs(self, sample: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(query, column) of every item that each query's history holds, for scores over the whole catalogue
        (column c is item c + 1): what ``holds`` says for every column, as the few pairs where it is True
        (about a query's position each) rather than a [queries, items] mask. The queries are every real
        target's, grouped by sample, each sample's in position order (the real rows of either layout, in
        order), given by their samples ([Q]): query q of sample s is at position q - (s's first query). Each
        item once per query, where the history holds it several times. Needs the table (``table=True``); its
        sizes come from the data: for the host."""
        target_ids, real = self._targets
        item, at = target_ids.flatten().long(), self.position.flatten().long()
        owner = self.sample.flatten().long()
        first = real.flatten() & (self.first[owner, item] == at)  # each item at its first position only
        item, at, owner = item[first], at[first], owner[first]
        queries = torch.bincount(sample.long(), minlength=len(self.first))
        start = torch.cumsum(queries, 0) - queries
        later = (queries[owner] - at - 1).clamp(min=0)  # the queries after the item's position hold it
        total = int(later.sum())
        group_start = torch.repeat_interleave(torch.cumsum(later, 0) - later, later, output_size=total)
        step = torch.arange(total, device=item.device) - group_start
        rows = torch.repeat_interleave(start[owner] + at + 1, later, output_size=total) + step
        return rows, torch.repeat_interleave(item - 1, later, output_size=total)

    def holds(self, sample: torch.Tensor, position: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """[..., K]: whether the history of each query (``sample``, ``position``: its leading shape) holds each
        of ``ids`` (in [0, width), broadcast against [..., 1]) before the query's position."""
        if self.dense:
            return self.first[sample[..., None], ids] < position[..., None]
        query = sample[..., None].long() * self.width + ids
        at = torch.searchsorted(self.keys, query).clamp(max=len(self.keys) - 1)  # a key's first: its least position
        return (self.keys[at] == query) & (self.first_position[at] < position[..., None])


@functools.cache
def _compiled_jagged_sums():
    """``HSTUObjectives._jagged_sums`` compiled once per process, dynamic in the event count: the losses'
    normalisations, scores, softmax and ranking head fused where eager PyTorch runs each as a kernel."""
    return torch.compile(HSTUObjectives._jagged_sums, dynamic=True)


class HSTUObjectives(nn.Module):
    """The dense part: the HSTU stack and the ranking head, from looked-up embeddings to the two losses.

    Holds no embedding table, so it is what megatron-core's DDP wraps (and what TorchRec's pipeline tracer
    treats as a leaf). ``losses`` takes the tensors of ``dense_inputs``: padded (the reference) or jagged
    (the fused attention kernel), by the ``attention`` choice and the device; with ``static=True`` the
    padded ones have a fixed length, and ``graph_growth`` says how a CUDA graph grows the jagged ones to a
    token capacity: shapes fixed per batch size (and capacity), with no host sync, so that they can be
    captured. ``retrieval`` is a resolved choice of ``RETRIEVAL_LOSSES`` (not ``auto``)."""

    def __init__(
        self,
        config: HSTUConfig,
        num_actions: int,
        temperature: float,
        attention: str = "padded",
        retrieval: str = "sampled",
        ranking_weight: float = 1.0,
        history_logit: bool = False,
    ):
        super().__init__()
        if retrieval not in RETRIEVAL_LOSSES[1:]:
            raise ValueError(f"unknown retrieval loss {retrieval!r}; valid: {', '.join(RETRIEVAL_LOSSES[1:])}")
        self.embedding_dim, self.temperature, self.attention = config.embedding_dim, temperature, attention
        self.retrieval, self.ranking_weight = retrieval, ranking_weight
        self.catalogue: int | None = None
        """Rows of the item table (items + 1), once known: what the full softmax scores against."""
        self.max_events = config.max_seq_len - 1  # the user token takes one position
        self.stack = HSTUStack(config)
        self.ranking_head = (
            nn.Sequential(
                nn.Linear(2 * config.embedding_dim, config.embedding_dim),
                nn.SiLU(),
                nn.Linear(config.embedding_dim, num_actions),
            )
            if ranking_weight
            else None
        )
        self.history_logit = nn.Parameter(torch.zeros(1)) if history_logit else None
        """A learned score added to the items already in the history that a query has read, in cosine units
        (the softmax adds it divided by the temperature, as the scores): how likely a user returns to an
        item. Learned from the training softmax, where the next item is or is not one already held; on data
        without returns (MovieLens never repeats an item) it turns negative, and the scores stop ranking the
        history's own items first. None: off."""

    def training_flops(self, lengths: list[int], negatives: int) -> int:
        """Model FLOPs of one training step (forward and backward, 3x the forward's matrix products) of a
        batch of histories with ``lengths`` events, each event scored against ``negatives`` items, counted on
        the jagged tokens (n + 1 per history, the user token first): per layer the two linear maps and, per
        causal pair, q.k and the weighted sum of v, per head; then the retrieval scores and the ranking
        head per event. Padding, recomputation, norms and pointwise ops are not counted."""
        stack, config = self.stack, self.stack.config
        width, heads = config.embedding_dim, config.num_heads
        qk, uv = heads * config.attention_dim, heads * config.hidden_dim
        tokens = sum(lengths) + len(lengths)
        pairs = sum((n + 1) * (n + 2) // 2 for n in lengths)
        per_layer = 2 * tokens * width * (2 * qk + 2 * uv) + 2 * tokens * uv * width + 2 * pairs * (qk + uv)
        head = self.ranking_head
        per_event = 2 * width * (1 + negatives) + (
            2 * (head[0].in_features * head[0].out_features + head[2].in_features * head[2].out_features) if head else 0
        )
        return 3 * (len(stack.layers) * per_layer + sum(lengths) * per_event)

    def negatives_per_event(self, batch_size: int, events: int, item_neg_rows: int) -> int:
        """How many items each event's retrieval softmax scores besides its target (``training_flops``'
        negatives), given the batch's ``item_neg`` rows (all samples together; with ``full`` the catalogue,
        ids 0 .. num_items): the sample's own rows for ``sampled``, every other item (id 0 is none) for
        ``full``, every event of the batch for ``in_batch``."""
        per_event = {"sampled": item_neg_rows // batch_size, "full": item_neg_rows - 2, "in_batch": events}
        return per_event[self.retrieval]

    def fused(self, device: torch.device) -> bool:
        """Whether the fused kernel (jagged layout) runs on ``device``."""
        return self.layout(device) == "fused"

    def layout(self, device: torch.device) -> str:
        """The ``attention`` that runs on ``device``: ``auto`` resolved (``ATTENTION``)."""
        interpreted = os.environ.get("TRITON_INTERPRET") == "1"
        if self.attention == "fused" and device.type != "cuda" and not interpreted:
            raise ValueError(
                f"attention='fused' runs a Triton kernel: it needs a CUDA device, not {device} "
                f"(TRITON_INTERPRET=1 runs it in Triton's CPU interpreter, slowly, for tests); "
                f"attention='grouped' and 'padded' run anywhere"
            )
        if self.attention != "auto":
            return self.attention
        if device.type != "cuda":
            return "grouped"
        return "fused" if importlib.util.find_spec("triton") is not None else "padded"

    def forward(self, batch: HSTUBatch, embeddings) -> tuple[torch.Tensor, torch.Tensor]:
        """Summed retrieval and (weighted) ranking losses over every position of every history."""
        return self.losses(*self.dense_inputs(batch, embeddings))

    def dense_inputs(
        self, batch: HSTUBatch, embeddings, static: bool = False, training: bool = True
    ) -> DenseInputs | JaggedInputs:
        """The inputs of ``losses``; with ``training=False`` (for ``last_states``) no negatives; ``static``
        pads to the model's length (the padded layout; the jagged one is grown by the graph)."""
        self.check_batch(batch, training)
        lengths = batch.sequence_lengths()
        target_ids, sampled_ids, actions, times = batch.values_of("item", "item_neg", "action", "time")
        items = embeddings["item"].values()
        looked_up = embeddings["item_neg"].values()
        negatives, negative_ids = (
            self._negatives(sampled_ids, looked_up, len(lengths)) if training else (looked_up[:0], sampled_ids[:0])
        )
        events, user = items + embeddings["action"].values(), embeddings["user"].values()
        if self.layout(items.device) != "padded":
            return JaggedInputs(
                events=events,
                targets=items,
                user=user,
                negatives=negatives,
                times=times,
                actions=actions,
                target_ids=target_ids,
                negative_ids=negative_ids,
                lengths=lengths,
            )
        pad = Padding(lengths, len(items), self.max_events if static else None)
        return DenseInputs(
            events=pad(events),
            targets=pad(items),
            user=user,
            negatives=negatives,
            times=pad(times),
            actions=pad(actions),
            target_ids=pad(target_ids),
            negative_ids=negative_ids,
            mask=pad.mask,
        )

    def check_batch(self, batch: HSTUBatch, training: bool = True) -> None:
        """Raise ``ValueError`` for a batch the model would read wrongly, naming the sample and what is wrong:
        its first four keys are not the ids the tables look up (``LOOKUP_KEYS``, in that order: TorchRec
        looks up keys by position) or it has no ``time``; a sample whose items, actions and times differ in
        number (the model aligns them by the items); a sample without exactly one user id; with the sampled
        softmax in training, samples with different numbers of negatives or none (each history's scores are
        its own row of them); a history longer than the model's ``max_seq_len`` events (the fused kernel's
        grid and the position tables are sized by it: the kernel would leave a longer history's later
        tokens without output; the padded layout would clamp its distances, or, padded to the model's
        length for graph capture, index past it). Read from the lengths in host memory: no wait for the
        GPU where the batch came from the host."""
        keys = batch.features.keys()
        if tuple(keys[: len(LOOKUP_KEYS)]) != LOOKUP_KEYS or "time" not in keys:
            raise ValueError(
                f"the batch's features are keyed {keys}: HSTURecommender needs {', '.join(LOOKUP_KEYS)} as the first "
                f"four keys, in that order (the ids its tables look up, by position), and a 'time' key"
            )
        rows = batch.lengths_on_host().view(len(keys), -1).tolist()  # lists: cheaper than tensor ops on 32 numbers
        items = rows[0]
        for key in ("action", "time"):
            other = rows[keys.index(key)]
            if other != items:
                sample = next(i for i, (a, b) in enumerate(zip(items, other)) if a != b)
                raise ValueError(
                    f"sample {sample} of the batch has {items[sample]} items but {other[sample]} {key!r} values: "
                    f"every event needs one item, one action and one time"
                )
        users = rows[LOOKUP_KEYS.index("user")]
        if users.count(1) != len(users):
            sample = next(i for i, n in enumerate(users) if n != 1)
            raise ValueError(f"sample {sample} of the batch has {users[sample]} 'user' ids: each history needs one")
        negatives = rows[LOOKUP_KEYS.index("item_neg")]
        if (
            training
            and self.retrieval == "sampled"
            and negatives
            and (min(negatives) < 1 or max(negatives) > min(negatives))
        ):
            raise ValueError(
                f"retrieval_loss='sampled' scores each history against its own 'item_neg' ids, as many for every "
                f"sample and at least one; this batch has {sorted(set(negatives))} per sample: give every sample "
                f"the same number of negatives (HistoryDataModule(negatives=...)), or use retrieval_loss='full' or "
                f"'in_batch'"
            )
        longest = max(items, default=0)
        if longest > self.max_events:
            sample = items.index(longest)
            raise ValueError(
                f"sample {sample} of the batch has a history of {longest} events, longer than the model's "
                f"max_seq_len={self.max_events}: cap the histories at {self.max_events} events (the data module's "
                f"max_seq_len) or raise the model's max_seq_len"
            )

    def graph_growth(self, inputs: DenseInputs | JaggedInputs) -> tuple[int | None, tuple[int, ...]]:
        """For ``GraphedMethod(rows=, grown=)``: the jagged inputs' token-wise tensors (events, targets, times,
        actions, target ids) grown to the token capacity (``token_capacity``), so that a graph serves every
        batch of the same size and capacity; nothing for the padded ones (static already)."""
        if not isinstance(inputs, JaggedInputs):
            return None, ()
        return token_capacity(len(inputs.events), self.max_events * len(inputs.lengths)), GROWN

    def _negatives(self, ids: torch.Tensor, looked_up: torch.Tensor, batch_size: int):
        """The ``item_neg`` rows and ids (the batch's) in the shape the retrieval loss takes (see
        ``DenseInputs``)."""
        if self.retrieval == "full":
            return self._catalogue(looked_up)
        if self.retrieval == "sampled":
            return looked_up.view(batch_size, -1, looked_up.shape[-1]), ids.view(batch_size, -1)
        return looked_up[:0], ids[:0]  # in_batch: the targets are the negatives

    def _catalogue(self, looked_up: torch.Tensor):
        """The full softmax's negatives: the item table's rows, looked up in order, and their ids."""
        if self.catalogue is not None and len(looked_up) != self.catalogue:
            raise ValueError(
                f"retrieval='full' scores every event against the whole item table, which "
                f"HSTURecommender.sparse_features puts under 'item_neg' ({self.catalogue} rows); these "
                f"embeddings have {len(looked_up)} 'item_neg' rows: look them up from "
                f"model.sparse_features(batch)"
            )
        return looked_up, torch.arange(len(looked_up), device=looked_up.device)  # row i is item i

    def losses(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The summed losses of ``dense_inputs``' tensors (either layout)."""
        if len(inputs) == len(JaggedInputs._fields) and inputs[-1].dim() == 1:
            return self._jagged_losses(*inputs)
        return self._padded_losses(*inputs)

    def _padded_losses(self, events, targets, user, negatives, times, actions, target_ids, negative_ids, mask):
        hidden = self.encode(events, user, times, mask)
        history = None
        if self.history_logit is not None:  # position j predicts event j, having read events 0 .. j - 1
            history = HistoryItems.padded(target_ids, mask, self._width(target_ids, negative_ids), self._table())

        def negative_scores(query):  # [B, L, negatives]
            if self.retrieval == "sampled":  # each sample's own negatives, for each of its positions
                return query @ F.normalize(negatives, dim=-1).transpose(1, 2), negative_ids[:, None, :]
            return self._pool_scores(query, negatives, negative_ids, targets.flatten(0, 1), target_ids.flatten())

        # The state before each event predicts that event; padded positions are computed and masked out.
        return self._sums(
            hidden[:, :-1], targets, actions, target_ids, mask.to(torch.float32), negative_scores, history
        )

    def _jagged_losses(self, events, targets, user, negatives, times, actions, target_ids, negative_ids, lengths):
        hidden, layout = self.encode_jagged(events, user, times, lengths)
        sample = layout.sample.clamp(max=len(lengths) - 1)
        history = None
        if self.history_logit is not None:  # event row j of a history predicts it, having read the rows before
            position = torch.arange(len(sample), device=sample.device) - layout.event_offsets[sample]
            width = self._width(target_ids, negative_ids)
            history = HistoryItems(target_ids, sample, position, layout.real, len(lengths), width, self._table())
        compiled = self.stack.config.compile_layers and hidden.is_cuda and history is None
        sums = _compiled_jagged_sums() if compiled else HSTUObjectives._jagged_sums
        return sums(
            self, hidden, layout.event_token, layout.real, sample, targets, actions, target_ids, negatives,
            negative_ids, history,
        )  # fmt: skip

    def _jagged_sums(
        self, hidden, event_token, real, sample, targets, actions, target_ids, negatives, negative_ids, history
    ):
        """The losses from the stack's jagged output: each event's state before it, its scores, the sums
        (``_sums``); with ``compile_layers`` on CUDA through ``torch.compile`` (``_compiled_jagged_sums``)."""
        rows = torch.arange(len(sample), device=sample.device)

        def negative_scores(query):  # [C, negatives]
            if self.retrieval == "sampled":  # [C, B * K] in one product, then each event's own sample's K
                batch, count = negatives.shape[:2]
                every = query @ F.normalize(negatives, dim=-1).flatten(0, 1).T
                return every.view(len(query), batch, count)[rows, sample], negative_ids[sample]
            return self._pool_scores(query, negatives, negative_ids, targets, target_ids)

        return self._sums(
            hidden.index_select(0, event_token - 1),
            targets,
            actions,
            target_ids,
            real.to(torch.float32),
            negative_scores,
            history,
        )

    def _pool_scores(self, query, negatives, negative_ids, targets, target_ids):
        """Scores against one pool shared by every position: the item table (``full``) or the targets of
        the whole batch (``in_batch``), and the pool's ids."""
        if self.retrieval == "in_batch":
            negatives, negative_ids = targets, target_ids
        elif self.retrieval == "full":  # the catalogue's rows are ids 0 .. num_items; id 0 is no item
            negatives, negative_ids = negatives[1:], negative_ids[1:]
        return query @ F.normalize(negatives, dim=-1).T, negative_ids

    def _sums(self, predicting, targets, actions, target_ids, weight, negative_scores, history=None):
        """Retrieval (softmax over the target and the negatives) and weighted ranking (next action) losses
        summed over the positions of ``weight`` (the padded [B, L] or jagged [C] layout alike).
        ``negative_scores(query)`` gives the negatives' cosine scores and their ids; a negative that is the
        target itself (an accidental hit) or no item (id 0) is left out of the softmax. The temperature
        divides the [positions, D] queries, not the [positions, items] scores (the same logits).
        ``history`` (``HistoryItems``, with the layout's positions): where the history logit is on, the items
        a position's history holds, the target's included, get it in their scores."""
        query = F.normalize(predicting, dim=-1) / self.temperature
        weight = weight.to(torch.float32)
        rows = None if history is None else (history.sample, history.position)
        if self.retrieval == "full":  # the target is among the scored rows already: plain cross-entropy
            # over the items 1 .. num_items (column c is id c + 1; a position without a target has id 0)
            query, target_ids, position_weight = query.flatten(0, -2), target_ids.flatten(), weight.flatten()
            rows = None if rows is None else tuple(r.flatten() for r in rows)
            if not query.is_cuda:  # the padded CPU layout: score only the real positions (no wait on a CPU)
                real = position_weight > 0
                query, target_ids, position_weight = query[real], target_ids[real], position_weight[real]
                rows = None if rows is None else tuple(r[real] for r in rows)
            scores, ids = negative_scores(query)
            if history is not None and not query.is_cuda:
                # The logit added in place at the (row, item) pairs the histories hold, a few per row, where
                # the mask of ``_held`` took five passes over [rows, items] (20% of the main job's step).
                # In place: the product that made the scores does not keep them for its backward.
                pairs = history.catalogue_pairs(rows[0])
                logit = (self.history_logit / self.temperature).to(scores.dtype)
                scores = scores.index_put_(pairs, logit.expand(len(pairs[0])), accumulate=True)
            else:
                scores = self._held(scores, history, rows, ids)
            retrieval = F.cross_entropy(scores.float(), target_ids - 1, ignore_index=-1, reduction="none")
            retrieval = (retrieval * position_weight).sum()
        else:
            scores, ids = negative_scores(query)
            positive = (query * F.normalize(targets, dim=-1)).sum(-1, keepdim=True)
            positive = self._held(positive, history, rows, target_ids[..., None])
            scores = self._held(scores, history, rows, ids)
            scores = scores.masked_fill((ids == target_ids[..., None]) | (ids == 0), -math.inf)
            logits = torch.cat([positive, scores], dim=-1).float()
            retrieval = ((torch.logsumexp(logits, dim=-1) - logits[..., 0]) * weight).sum()  # positive at 0
        return retrieval, self._ranking(predicting, targets, actions, weight)

    def _held(self, scores, history, rows, ids) -> torch.Tensor:
        """``scores`` plus the history logit (over the temperature) where a query's history holds the item."""
        if history is None:
            return scores
        held = history.holds(*rows, ids)
        return scores + held.to(scores.dtype) * (self.history_logit / self.temperature).to(scores.dtype)

    def _table(self) -> bool | None:
        """``HistoryItems``' ``table``: kept for the full softmax, which queries every column; else by size."""
        return True if self.retrieval == "full" else None

    def _width(self, target_ids: torch.Tensor, negative_ids: torch.Tensor) -> int:
        """Columns of ``HistoryItems``' table: the catalogue, once known (no host sync), else the largest id."""
        if self.catalogue is not None:
            return self.catalogue
        return max((int(ids.max()) for ids in (target_ids, negative_ids) if ids.numel()), default=0) + 1

    def with_history_logit(self, scores: torch.Tensor, history: JaggedTensor) -> torch.Tensor:
        """[B, items + 1] ranking scores (cosine) plus the history logit at each sample's history items
        (``history``: the histories the scores were computed from); the scores as they are where it is off."""
        if self.history_logit is None:
            return scores
        held = held_items(scores, history.values(), history.lengths())
        return scores + held.to(scores.dtype) * self.history_logit.detach().to(scores.dtype)

    def _ranking(self, predicting, targets, actions, weight) -> torch.Tensor:
        if self.ranking_head is None:
            return weight.new_zeros(())
        logits = self.ranking_head(torch.cat([predicting, targets], dim=-1)).float()
        ranking = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), actions.reshape(-1), reduction="none")
        return self.ranking_weight * (ranking.view_as(weight) * weight).sum()

    def encode(self, events, user, times, mask) -> torch.Tensor:
        """Padded: hidden states [B, 1 + L, D] over (user token, events)."""
        tokens = torch.cat([user[:, None], events], dim=1)
        token_mask = torch.cat([torch.ones_like(mask[:, :1]), mask], dim=1)
        token_times = torch.cat([times[:, :1], times], dim=1)
        return self.stack(tokens, token_mask, token_times)

    def encode_jagged(self, events, user, times, lengths) -> tuple[torch.Tensor, JaggedLayout]:
        """Jagged: hidden states [C + B, D] over every history's (user token, events), and where they are."""
        layout = JaggedLayout(lengths, len(events))
        return self.stack.jagged(
            layout.tokens(user, events),
            layout.token_offsets,
            layout.tokens(layout.user_times(times), times),
            grouped=self.layout(events.device) == "grouped",
        ), layout

    def last_states(self, batch: HSTUBatch, embeddings) -> torch.Tensor:
        """[B, D] each history's state after its last event (what ranks the next item)."""
        inputs = self.dense_inputs(batch, embeddings, training=False)
        if isinstance(inputs, JaggedInputs):
            hidden, layout = self.encode_jagged(inputs.events, inputs.user, inputs.times, inputs.lengths)
            return hidden[layout.token_offsets[1:] - 1]
        hidden = self.encode(inputs.events, inputs.user, inputs.times, inputs.mask)
        return hidden[torch.arange(len(inputs.mask)), inputs.mask.sum(1)]


def dense_adamw(params, graphed: bool = False, **kwargs) -> torch.optim.AdamW:
    """The dense part's AdamW: ``GraphedAdamW`` where ``graphed`` (its step captured), else torch's. On CUDA
    parameters the fused implementation (``fused=True``: one pass over each parameter, its gradient and its
    two moments, where torch's default there, foreach, makes about ten); on the CPU torch's default."""
    params = list(params)
    tensors = [p for group in params for p in group["params"]] if params and isinstance(params[0], dict) else params
    if tensors and all(p.is_cuda for p in tensors):
        kwargs.setdefault("fused", True)
    return (GraphedAdamW if graphed else torch.optim.AdamW)(params, **kwargs)


def with_catalogue(features: KeyedJaggedTensor, rows: int) -> KeyedJaggedTensor:
    """``features`` with ``item_neg`` replaced by the item ids ``0 .. rows - 1``, all on the first sample.
    Uses the per-key lengths the batch already knows: no host sync."""
    keys, stride = features.keys(), features.stride()
    values, lengths, per_key = [], [], []
    for key in keys:
        if key == "item_neg":
            ids = torch.arange(rows, device=features.values().device, dtype=features.values().dtype)
            count = torch.zeros(stride, device=ids.device, dtype=features.lengths().dtype)
            values.append(ids)
            lengths.append(count.index_fill(0, torch.zeros_like(count[:1]), rows))
            per_key.append(rows)
        else:
            jagged = features[key]
            values.append(jagged.values()), lengths.append(jagged.lengths()), per_key.append(len(jagged.values()))
    return KeyedJaggedTensor(
        keys=keys, values=torch.cat(values), lengths=torch.cat(lengths), stride=stride, length_per_key=per_key
    )


def embedding_tables(dim: int, num_items: int, num_users: int, num_actions: int) -> list[EmbeddingConfig]:
    """Item ids (also the negatives), actions and users; row 0 of item and user means none. Every table
    starts at the item table's scale (TorchRec's default, uniform within 1/sqrt(rows)): an event is the sum
    of its item's and its action's rows, and by the default the 5-row action table would start 18 times
    larger than the item rows on ML-100K and drown them."""
    bound = (num_items + 1) ** -0.5
    scale = dict(embedding_dim=dim, weight_init_min=-bound, weight_init_max=bound)
    return [
        EmbeddingConfig(name="item", num_embeddings=num_items + 1, feature_names=["item", "item_neg"], **scale),
        EmbeddingConfig(name="action", num_embeddings=num_actions, feature_names=["action"], **scale),
        EmbeddingConfig(name="user", num_embeddings=num_users + 1, feature_names=["user"], **scale),
    ]
