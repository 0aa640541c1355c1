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

import math

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torchrec import EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from ..engine import SKIPPED, BatchView
from ..hstu.batch import HSTUBatch
from ..hstu.dense_grads import MegatronDenseGrads
from ..hstu.loop import global_token_scale, sparse_features
from ..hstu.shuffler import BalancedShuffler
from ..hstu.sparse import ShardedEmbeddings
from .hstu_layers import HSTUConfig, HSTUStack, to_padded

SPARSE_OPTIMIZERS = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad, "adam": torch.optim.Adam}
"""Optimizers TorchRec fuses into the embedding backward."""


class HSTURecommender(pl.LightningModule):
    def __init__(self, embedding_dim: int = 64, num_layers: int = 2, num_heads: int = 2, attention_dim: int = 32,
                 hidden_dim: int = 32, max_seq_len: int = 200, dropout: float = 0.1, temperature: float = 0.05,
                 lr: float = 1e-3, sparse_lr: float = 0.05, sparse_optimizer: str = "adagrad",
                 balance_batches: bool = True, on_nonfinite_loss: str = "raise", cache_load_factor: float | None = None,
                 num_items: int | None = None, num_users: int | None = None, num_actions: int | None = None):
        super().__init__()
        if sparse_optimizer not in SPARSE_OPTIMIZERS:
            raise ValueError(f"unknown sparse_optimizer {sparse_optimizer!r}; valid: {', '.join(SPARSE_OPTIMIZERS)}")
        if on_nonfinite_loss not in ("raise", "skip"):
            raise ValueError(f"unknown on_nonfinite_loss {on_nonfinite_loss!r}; valid: raise, skip")
        self.save_hyperparameters()
        config = HSTUConfig(embedding_dim, num_layers, num_heads, attention_dim, hidden_dim, max_seq_len + 1,
                            dropout=dropout)
        self.objectives = HSTUObjectives(config, num_actions or 5, temperature)
        self.embeddings: ShardedEmbeddings | None = None
        self.balance_totals = [0.0, 0.0, 0]
        """Sums of the shuffler's max/mean rank cost before and after, and the number of global batches."""
        self.skipped_batches: list[int] = []
        """Batches whose step was skipped because a rank's loss was not finite."""
        self._nonfinite: set[int] = set()

    # ----- built once the process group exists ------------------------------------------------------

    def configure_model(self) -> None:
        if self.embeddings is not None:
            return
        data = self.trainer.datamodule
        hp = self.hparams
        num_items, num_users = hp.num_items or data.num_items, hp.num_users or data.num_users
        self.num_items = num_items
        device = self.trainer.strategy.root_device
        self.embeddings = ShardedEmbeddings(
            embedding_tables(hp.embedding_dim, num_items, num_users, hp.num_actions or data.num_actions), device,
            optimizer=SPARSE_OPTIMIZERS[hp.sparse_optimizer], optimizer_kwargs={"lr": hp.sparse_lr},
            cache_load_factor=hp.cache_load_factor)
        self.dense_grads = MegatronDenseGrads(self.objectives.to(device))
        self.shuffler = BalancedShuffler(self.trainer.datamodule.batch_size, enabled=hp.balance_batches)

    def configure_optimizers(self):
        # the sparse tables have their own (fused) optimizer
        return torch.optim.AdamW(self.objectives.parameters(), lr=self.hparams.lr)

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
        b["input_dist_splits"] = self.embeddings.start_input_dist(sparse_features(b["shuffled_batch"]))

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
        tokens = b["shuffled_batch"].sequence_lengths().sum().to(torch.float32)
        dist.all_reduce(tokens)  # stays a tensor: loss normalisation needs no host sync
        b["global_tokens"] = tokens

    def hstu_compute_output_dist(self, b: BatchView) -> None:
        b["embeddings"] = self.embeddings.compute_output_dist(b["sparse_input"])

    def hstu_finalize_model_grads(self, b: BatchView) -> None:
        self.dense_grads.finalize()
        if b.index in self._nonfinite:
            for p in self.objectives.parameters():
                p.grad = None  # no dense step either: the optimizer skips parameters without gradients
        b["reduced_grads"] = True

    def hstu_watchdog(self, b: BatchView) -> None:
        if b.index not in self._nonfinite:
            return
        self._nonfinite.discard(b.index)
        if self.hparams.on_nonfinite_loss == "raise":
            raise FloatingPointError(f"non-finite loss at batch {b.index} (on at least one rank); the step was "
                                     f"not applied")
        self.skipped_batches.append(b.index)

    # ----- checkpoints ---------------------------------------------------------------------------------

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        # The fused sparse optimizer is not a Lightning optimizer: its state (sharded, like the tables)
        # travels in an entry of its own, which the strategy writes through torch.distributed.checkpoint.
        checkpoint["sparse_optimizer"] = self.embeddings.model_parallel.fused_optimizer.state_dict()

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        # Through the strategy, DCP has already filled the live state in place; this also loads a
        # checkpoint dict that was read some other way.
        if "sparse_optimizer" in checkpoint:
            self.embeddings.model_parallel.fused_optimizer.load_state_dict(checkpoint["sparse_optimizer"])

    def on_fit_end(self) -> None:
        before, after, batches = self.balance_totals
        if batches and self.trainer.is_global_zero and self.shuffler.active:
            print(f"\nbalanced shuffler: max/mean rank cost {before / batches:.3f} -> {after / batches:.3f} "
                  f"(mean over {batches} global batches)")

    # ----- training and evaluation --------------------------------------------------------------------

    def training_step(self, batch: HSTUBatch, batch_idx: int):
        slots = self.trainer.strategy.batch_slots
        embeddings = slots["embeddings"]
        retrieval, ranking = self.objectives(batch, embeddings)
        scale = global_token_scale(slots["global_tokens"])
        loss = (retrieval + ranking) * scale
        if not self.trainer.strategy.all_ranks(bool(torch.isfinite(loss))):
            # Every rank must still run backward (its all-to-alls and all-reduces are collectives), and no
            # non-finite gradient may reach the fused embedding update: backpropagate an exact zero.
            self._nonfinite.add(batch_idx)
            loss = sum(p.sum() for p in self.objectives.parameters()) * 0.0
            loss = loss + sum(jt.values().sum() for jt in embeddings.values()) * 0.0
        self.log_dict({"train/retrieval": retrieval * scale, "train/ranking": ranking * scale}, batch_size=batch.size)
        self.log("train/loss", loss, prog_bar=True, batch_size=batch.size)
        if self.shuffler.last_balance is not None:
            self.log("shuffle/max_over_mean", self.shuffler.last_balance.after, batch_size=batch.size)
        return loss

    def validation_step(self, batch: HSTUBatch, batch_idx: int):
        """Leave-last-out: rank the held-out item among all items by the state after the whole history."""
        embeddings = self.embeddings(sparse_features(batch))
        hidden, _, mask = self.objectives.encode(batch, embeddings)
        last = hidden[torch.arange(len(mask)), mask.sum(1)]  # the state after the last event
        scores = F.normalize(last, dim=-1) @ F.normalize(self.all_item_embeddings(), dim=-1).T
        scores[:, 0] = -math.inf  # id 0 is no item
        target = batch.features["target"].values()
        rank = (scores > scores.gather(1, target[:, None])).sum(1)
        hits = (rank < 10).float()
        self.log("val/HR@10", hits.mean(), batch_size=len(rank), sync_dist=True)
        self.log("val/NDCG@10", (hits / torch.log2(rank.float() + 2)).mean(), batch_size=len(rank), sync_dist=True)

    def all_item_embeddings(self) -> torch.Tensor:
        """Every item's embedding [num_items + 1, D], looked up through the sharded tables."""
        ids = torch.arange(self.num_items + 1, device=self.device)
        none = torch.zeros_like(ids)
        features = KeyedJaggedTensor.from_lengths_sync(  # one id per row under "item", nothing elsewhere
            keys=["item", "item_neg", "action", "user"], values=ids,
            lengths=torch.cat([torch.ones_like(ids), none, none, none]))
        return self.embeddings(features)["item"].values()


class HSTUObjectives(nn.Module):
    """The dense part: the HSTU stack and the ranking head, from looked-up embeddings to the two losses.

    Holds no embedding table, so it is what megatron-core's DDP wraps (and what TorchRec's pipeline tracer
    treats as a leaf)."""

    def __init__(self, config: HSTUConfig, num_actions: int, temperature: float):
        super().__init__()
        self.embedding_dim, self.temperature = config.embedding_dim, temperature
        self.stack = HSTUStack(config)
        self.ranking_head = nn.Sequential(nn.Linear(2 * config.embedding_dim, config.embedding_dim), nn.SiLU(),
                                          nn.Linear(config.embedding_dim, num_actions))

    def forward(self, batch: HSTUBatch, embeddings) -> tuple[torch.Tensor, torch.Tensor]:
        """Summed retrieval and ranking losses over every position of every history."""
        lengths = batch.sequence_lengths()
        hidden, targets, mask = self.encode(batch, embeddings)
        predicting = hidden[:, :-1][mask]  # the state before each event predicts that event
        target = targets[mask]
        # Each position is scored against its own sample's negatives, so the summed loss is additive over
        # samples (how the ranks split a global batch does not change it); one matmul, then a gather.
        negatives = F.normalize(embeddings["item_neg"].values(), dim=-1)  # [B * K, D]
        per_sample = len(negatives) // len(lengths)
        sample = torch.repeat_interleave(torch.arange(len(lengths), device=lengths.device), lengths)
        columns = sample[:, None] * per_sample + torch.arange(per_sample, device=lengths.device)[None]
        query = F.normalize(predicting, dim=-1)
        positive = (query * F.normalize(target, dim=-1)).sum(-1, keepdim=True)
        negative = (query @ negatives.T).gather(1, columns)
        logits = torch.cat([positive, negative], dim=1) / self.temperature
        retrieval = F.cross_entropy(logits, torch.zeros(len(logits), dtype=torch.long, device=logits.device),
                                    reduction="sum")
        actions = batch.features["action"].values()
        ranking = F.cross_entropy(self.ranking_head(torch.cat([predicting, target], dim=-1)), actions, reduction="sum")
        return retrieval, ranking

    def encode(self, batch: HSTUBatch, embeddings):
        """Hidden states [B, 1 + L, D] over (user token, events), the item embeddings [B, L, D], the mask [B, L]."""
        lengths = batch.sequence_lengths()
        items = embeddings["item"].values()
        events, mask = to_padded(items + embeddings["action"].values(), lengths)
        targets, _ = to_padded(items, lengths)
        times, _ = to_padded(batch.features["time"].values(), lengths)
        user = embeddings["user"].values()[:, None]
        tokens = torch.cat([user, events], dim=1)
        token_mask = torch.cat([torch.ones_like(mask[:, :1]), mask], dim=1)
        token_times = torch.cat([times[:, :1], times], dim=1)
        return self.stack(tokens, token_mask, token_times), targets, mask


def embedding_tables(dim: int, num_items: int, num_users: int, num_actions: int) -> list[EmbeddingConfig]:
    """Item ids (also the sampled negatives), actions and users; row 0 of item and user means none."""
    return [
        EmbeddingConfig(name="item", embedding_dim=dim, num_embeddings=num_items + 1, feature_names=["item", "item_neg"]),
        EmbeddingConfig(name="action", embedding_dim=dim, num_embeddings=num_actions, feature_names=["action"]),
        EmbeddingConfig(name="user", embedding_dim=dim, num_embeddings=num_users + 1, feature_names=["user"]),
    ]
