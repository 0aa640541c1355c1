"""The small HSTU model and synthetic data the CPU tests train (also imported by tests/scripts/)."""

from lightning_hstu.data.histories import SyntheticHistories

SMALL_MODEL = dict(embedding_dim=16, num_layers=1, num_heads=2, attention_dim=8, hidden_dim=8, max_seq_len=32,
                   dropout=0.0)


def small_data(**kwargs):
    defaults = dict(num_users=96, num_items=200, max_seq_len=32, batch_size=8, negatives=4)
    return SyntheticHistories(**{**defaults, **kwargs})
