"""The small HSTU models and synthetic data the tests train (also imported by tests/scripts/): one size for the
CPU, and one for the GPU, where the fused attention kernel needs heads of at least 16 wide."""

from lightning_hstu.data.histories import SyntheticHistories

SMALL_MODEL = dict(
    embedding_dim=16, num_layers=1, num_heads=2, attention_dim=8, hidden_dim=8, max_seq_len=32, dropout=0.0
)

GPU_MODEL = dict(
    embedding_dim=64,
    num_layers=2,
    num_heads=2,
    attention_dim=32,
    hidden_dim=32,
    max_seq_len=64,
    dropout=0.0,
    sparse_optimizer="sgd",
)


def lengths_apart(monkeypatch) -> list[int]:
    """Has the grouped attention make a group of each length (no price for a group: at the tests' short
    lengths the default puts every history in one); returns the group counts it makes."""
    from lightning_hstu.models import hstu_layers

    made, grouping = [], hstu_layers.length_groups

    def each_length(lengths):
        groups = grouping(lengths, overhead=0)
        made.append(len(groups))
        return groups

    monkeypatch.setattr(hstu_layers, "length_groups", each_length)
    return made


def small_data(**kwargs):
    defaults = dict(num_users=96, num_items=200, max_seq_len=32, batch_size=8, negatives=4)
    return SyntheticHistories(**{**defaults, **kwargs})


def gpu_data(**kwargs):
    return SyntheticHistories(
        **{**dict(num_users=256, num_items=1000, max_seq_len=64, batch_size=16, negatives=8), **kwargs}
    )


def model_and_data(accelerator: str):
    """The model's keyword arguments and the data module factory for ``accelerator`` ("cpu" or "gpu")."""
    return (GPU_MODEL, gpu_data) if accelerator == "gpu" else (SMALL_MODEL, small_data)
