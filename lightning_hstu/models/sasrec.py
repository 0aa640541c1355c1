"""SASRec ("Self-Attentive Sequential Recommendation", Kang and McAuley 2018), the baseline HSTU is measured
against: item embeddings plus learned positions, causal softmax self-attention blocks, and the next item
scored by the dot product with the (shared) item embeddings, trained with a full softmax over the
catalogue. Plain PyTorch under any Lightning strategy; the same data module (``HSTUBatch`` histories;
the action, time and user features are not used) and the same evaluation (``RankingEvaluation``) as HSTU.
``history_logit`` adds the same learned logit for the items already in the history as HSTU's
(``HSTUObjectives.history_logit``), so that the two compare with it too.
"""

import lightning.pytorch as pl
import torch
from torch import nn
from torch.nn import functional as F

from ..checks import at_least
from ..data.evaluation import held_items
from ..hstu.batch import HSTUBatch
from .hstu import HistoryItems
from .hstu_layers import Padding
from .ranking import RankingEvaluation


class SASRecRecommender(RankingEvaluation, pl.LightningModule):
    HISTORY_SCALE = 10.0
    """Logits per unit of ``history_logit``: a scalar under Adam moves about ``lr`` per step, and at the
    example's rate (2e-3, 7 steps an epoch) it could not go past one logit in 60 epochs; HSTU's moves
    ``1 / temperature`` = 10 logits per unit at its example's temperature."""

    def __init__(
        self,
        embedding_dim: int = 64,
        num_layers: int = 2,
        num_heads: int = 1,
        max_seq_len: int = 200,
        dropout: float = 0.2,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        num_items: int | None = None,
        history_logit: bool = False,
    ):
        super().__init__()
        at_least(1, embedding_dim=embedding_dim, num_layers=num_layers, num_heads=num_heads, max_seq_len=max_seq_len)
        at_least(1, num_items=num_items)  # None: from the data
        at_least(0, dropout=dropout, lr=lr, weight_decay=weight_decay)
        if embedding_dim % num_heads:
            raise ValueError(f"embedding_dim ({embedding_dim}) must be divisible by num_heads ({num_heads})")
        self.save_hyperparameters()
        self.items: nn.Embedding | None = None  # sized by the data in configure_model, unless num_items is given
        self.positions = nn.Embedding(max_seq_len, embedding_dim)
        self.dropout = nn.Dropout(dropout)
        block = nn.TransformerEncoderLayer(
            embedding_dim,
            num_heads,
            dim_feedforward=embedding_dim,
            dropout=dropout,
            activation="relu",
            batch_first=True,
            norm_first=True,
        )
        self.blocks = nn.TransformerEncoder(
            block, num_layers, norm=nn.LayerNorm(embedding_dim), enable_nested_tensor=False
        )
        nn.init.xavier_normal_(self.positions.weight)
        self.history_logit = nn.Parameter(torch.zeros(1)) if history_logit else None
        """A learned logit for the items a position's history already holds, in units of ``HISTORY_SCALE``
        logits (HSTU's is in cosine units, ``1 / temperature`` logits)."""
        if num_items is not None:
            self._make_items(num_items)

    def _make_items(self, num_items: int) -> None:
        self.num_items = num_items
        self.items = nn.Embedding(num_items + 1, self.hparams.embedding_dim, padding_idx=0)
        with torch.no_grad():  # Xavier, as the paper's code: N(0, 1) rows make the first logits huge
            nn.init.xavier_normal_(self.items.weight)
            self.items.weight[0] = 0

    def configure_model(self) -> None:
        data_items = getattr(self.trainer.datamodule, "num_items", None)
        if self.items is None:
            self._make_items(data_items)
        elif data_items is not None and self.num_items < data_items:
            raise ValueError(
                f"num_items={self.num_items} is smaller than the data's {data_items} items: leave it unset "
                f"(None) to size the item table by the data"
            )

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)

    def encode(self, batch: HSTUBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Hidden states [B, L, D] of the histories padded to the batch's longest (histories start at
        position 0, so the causal mask alone keeps padding out of every real position), and the mask."""
        history = batch.features["item"]
        if history.lengths().max() > self.hparams.max_seq_len:
            raise ValueError(
                f"a history of {int(history.lengths().max())} events is longer than the model's "
                f"max_seq_len={self.hparams.max_seq_len}: make the data module's max_seq_len equal"
            )
        padding = Padding(history.lengths(), len(history.values()))
        ids, mask = padding(history.values()), padding.mask
        length = ids.shape[1]
        x = self.items(ids) * self.hparams.embedding_dim**0.5 + self.positions.weight[:length]
        x = self.dropout(x) * mask[..., None]
        causal = torch.ones(length, length, dtype=torch.bool, device=x.device).triu(1)
        return self.blocks(x, mask=causal, is_causal=True), mask

    def training_step(self, batch: HSTUBatch, batch_idx: int):
        """Every position predicts its next item, softmax over all items (id 0 excluded)."""
        hidden, mask = self.encode(batch)
        ids = Padding(batch.sequence_lengths(), len(batch.features["item"].values()))(batch.features["item"].values())
        logits = hidden[:, :-1][mask[:, 1:]] @ self.items.weight.T
        if self.history_logit is not None:  # position p has read the items at positions 0 .. p
            history = HistoryItems.padded(ids, mask, logits.shape[-1], table=True)
            predicting = mask[:, 1:]
            columns = torch.arange(logits.shape[-1], device=ids.device)
            sample, position = history.sample[:, :-1][predicting], history.position[:, :-1][predicting]
            held = history.holds(sample, position + 1, columns)
            logits = logits + self.HISTORY_SCALE * self.history_logit * held
        logits[:, 0] = -torch.inf
        loss = F.cross_entropy(logits, ids[:, 1:][mask[:, 1:]])
        self.log("train/loss", loss, prog_bar=True, batch_size=batch.size)
        return loss

    def score_items(self, batch: HSTUBatch) -> torch.Tensor:
        """Scores in fp32 under any precision (bf16's rounding would tie items with the held-out one)."""
        hidden, mask = self.encode(batch)
        last = hidden[torch.arange(len(mask), device=mask.device), mask.sum(1) - 1]
        with torch.autocast(last.device.type, enabled=False):
            scores = last.float() @ self.items.weight.float().T
        if self.history_logit is None:
            return scores
        history = batch.features["item"]
        held = held_items(scores, history.values(), history.lengths())
        return scores + self.HISTORY_SCALE * self.history_logit.detach().float() * held

    def evaluation_weights(self) -> list[torch.Tensor]:
        return list(self.parameters())
