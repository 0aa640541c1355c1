"""A batch of user histories for HSTU, as TorchRec wants it: one KeyedJaggedTensor; and the check that its
ids fit their embedding tables."""

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


@dataclass
class HSTUBatch:
    """User histories: ``features`` holds, per sample, the event sequence under ``sequence_keys`` (one
    value per event: item ids, actions) and contextual features under the other keys (one value each).

    Implements what TorchRec's pipelines expect of a batch (``to``, ``record_stream``, ``pin_memory``).
    """

    features: KeyedJaggedTensor
    sequence_keys: tuple[str, ...] = ("item", "action")

    @property
    def size(self) -> int:
        return self.features.stride()

    def sequence_lengths(self) -> torch.Tensor:
        return self.features[self.sequence_keys[0]].lengths()

    def to(self, device: torch.device, non_blocking: bool = True) -> "HSTUBatch":
        # Non-blocking by default: Lightning's transfer passes no flag for non-tensor batches, and the h2d
        # task runs on its own stream, whose copy the engine's events order before every consumer.
        return replace(self, features=self.features.to(device=device, non_blocking=non_blocking))

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        self.features.record_stream(stream)

    def pin_memory(self) -> "HSTUBatch":
        return replace(self, features=self.features.pin_memory())

    def select(self, samples: torch.Tensor) -> "HSTUBatch":
        """The batch of the given samples, in that order."""
        keys = self.features.keys()
        lengths = self.features.lengths().view(len(keys), -1)
        per_key = self.features.values().split(self.features.length_per_key())
        picked = [_gather_jagged(values, lengths[k], samples) for k, values in enumerate(per_key)]
        return self._with(keys, [v for v, _ in picked], [n for _, n in picked])

    @staticmethod
    def concat(batches: Sequence["HSTUBatch"]) -> "HSTUBatch":
        """One batch with the samples of ``batches`` one after the other (same keys in each)."""
        first = batches[0]
        keys = first.features.keys()
        values, lengths = [], []
        for k, key in enumerate(keys):
            values.append(torch.cat([b.features[key].values() for b in batches]))
            lengths.append(torch.cat([b.features[key].lengths() for b in batches]))
        return first._with(keys, values, lengths)

    def _with(self, keys: list[str], values: list[torch.Tensor], lengths: list[torch.Tensor]) -> "HSTUBatch":
        features = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=torch.cat(values), lengths=torch.cat(lengths))
        return replace(self, features=features)


def _gather_jagged(values: torch.Tensor, lengths: torch.Tensor, samples: torch.Tensor):
    """The segments of ``samples`` from a jagged (values, lengths) pair, concatenated, and their lengths."""
    starts = torch.cumsum(lengths, 0) - lengths
    picked_lengths = lengths[samples]
    segment = torch.repeat_interleave(torch.arange(len(samples), device=values.device), picked_lengths)
    first_of_segment = torch.cumsum(picked_lengths, 0) - picked_lengths
    position = starts[samples][segment] + torch.arange(len(segment), device=values.device) - first_of_segment[segment]
    return values[position], picked_lengths


class IdError(ValueError):
    """An id outside its embedding table (negative, or not below the table's row count). fbgemm would look
    it up as row 0 and train on."""


def check_ids(
    features: KeyedJaggedTensor,
    rows: Mapping[str, int],
    sample_name: Callable[[int], str] = lambda sample: f"sample {sample}",
) -> None:
    """Raise ``IdError`` for the first id of a feature named in ``rows`` (feature -> its table's row count)
    that is outside ``0 .. rows - 1``, naming the feature, the id, the sample and the table size.

    For batches in host memory (the loader's, or a CPU lookup's): on a GPU the check would wait for it.
    """
    keys = features.keys()
    per_key = features.values().split(features.length_per_key())
    lengths = features.lengths().view(len(keys), -1)
    for k, key in enumerate(keys):
        size = rows.get(key)
        if size is None or per_key[k].numel() == 0:
            continue
        outside = (per_key[k] < 0) | (per_key[k] >= size)
        if not bool(outside.any()):
            continue
        position = int(outside.nonzero()[0])
        sample = int(torch.searchsorted(torch.cumsum(lengths[k], 0), position, right=True))
        raise IdError(
            f"feature '{key}' has id {int(per_key[k][position])} ({sample_name(sample)}), outside its "
            f"embedding table of {size} rows (valid ids: 0 to {size - 1})"
        )


def check_table_sizes(model: Mapping[str, int], data: Mapping[str, int]) -> None:
    """Refuse model settings (``num_items``, ...) that make a table smaller than the data's ids need;
    ``model`` and ``data`` map each setting to the model's and the data's value."""
    for name, size in model.items():
        if size < data[name]:
            raise IdError(
                f"{name}={size} is smaller than the data's {name} ({data[name]}): its largest ids would "
                f"fall outside the embedding table; set {name} to at least {data[name]}, or leave it "
                f"unset to take the data's"
            )
