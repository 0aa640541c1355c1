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
    host_lengths: torch.Tensor | None = None
    """The features' lengths in host memory, where the batch came from there (``to`` keeps them), so that
    the shuffler plans on the host without waiting for the GPU."""

    @property
    def size(self) -> int:
        return self.features.stride()

    def sequence_lengths(self) -> torch.Tensor:
        """The histories' lengths (the first sequence key's): a view of the features' lengths."""
        features = self.features
        index = features.keys().index(self.sequence_keys[0])
        return features.lengths().reshape(len(features.keys()), -1)[index]

    def values_of(self, *keys: str) -> tuple[torch.Tensor, ...]:
        """The values of ``keys``, in that order: views of the features' values, made by one split where the
        KeyedJaggedTensor knows its per-key counts (on the step's host a lookup per key through TorchRec's
        ``KeyedJaggedTensor.__getitem__`` makes a JaggedTensor and two slices each)."""
        features = self.features
        per_key = features.length_per_key_or_none()
        if per_key is None:
            return tuple(features[key].values() for key in keys)
        every = dict(zip(features.keys(), features.values().split(per_key)))
        return tuple(every[key] for key in keys)

    def lengths_on_host(self) -> torch.Tensor:
        """The features' lengths (every key's, key after key) in host memory: a copy from the GPU (which
        waits for it) only where the batch was never on the host."""
        if self.host_lengths is not None:
            return self.host_lengths
        return self.features.lengths().cpu()

    def to(self, device: torch.device, non_blocking: bool = True) -> "HSTUBatch":
        # Non-blocking by default: Lightning's transfer passes no flag for non-tensor batches, and the h2d
        # task runs on its own stream, whose copy the engine's events order before every consumer.
        lengths = self.features.lengths()
        host = lengths if lengths.device.type == "cpu" else self.host_lengths
        return replace(self, features=self.features.to(device=device, non_blocking=non_blocking), host_lengths=host)

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        self.features.record_stream(stream)

    def pin_memory(self) -> "HSTUBatch":
        return replace(self, features=self.features.pin_memory())

    def select(self, samples: torch.Tensor) -> "HSTUBatch":
        """The batch of the given samples, in that order."""
        lengths = self.lengths_on_host().view(1, len(self.features.keys()), self.size)
        samples = samples.cpu()
        return self.take(
            self.features.values(), lengths, self.features.values().numel(), torch.zeros_like(samples), samples
        )

    def take(
        self, values: torch.Tensor, lengths: torch.Tensor, width: int, pieces: torch.Tensor, samples: torch.Tensor
    ) -> "HSTUBatch":
        """A batch of this one's keys made of samples of several batches whose values lie one after another
        in ``values``, ``width`` apart: ``lengths`` [batches, keys, samples] (host memory) are their
        lengths; the new batch holds, in order, sample ``samples[j]`` of batch ``pieces[j]``. Planned on the
        host from the lengths, then one gather on the values' device: no wait for the device."""
        keys = self.features.keys()
        flat = lengths.flatten(1)
        starts = (flat.cumsum(1) - flat).view(lengths.shape) + (torch.arange(len(lengths)) * width)[:, None, None]
        picked = lengths[pieces, :, samples].T.reshape(-1)  # key after key, as a KJT lays them out
        # each picked history's start in ``values`` minus its start in the new values
        shift = starts[pieces, :, samples].T.reshape(-1) - (picked.cumsum(0) - picked)
        total = int(picked.sum())
        plan = torch.stack([shift, picked])
        if values.is_cuda:
            plan = plan.pin_memory()
        shift_on, picked_on = plan.to(values.device, non_blocking=True)
        position = torch.repeat_interleave(shift_on, picked_on, output_size=total)
        position += torch.arange(total, device=values.device)
        features = KeyedJaggedTensor(
            keys=keys,
            values=values[position],
            lengths=picked_on.to(self.features.lengths().dtype),
            stride=len(samples),
            length_per_key=picked.view(len(keys), -1).sum(1).tolist(),
        )
        return replace(self, features=features, host_lengths=picked)

    @staticmethod
    def concat(batches: Sequence["HSTUBatch"]) -> "HSTUBatch":
        """One batch with the samples of ``batches`` one after the other (same keys in each)."""
        first = batches[0]
        keys = first.features.keys()
        values = [torch.cat([b.features[key].values() for b in batches]) for key in keys]
        lengths = [torch.cat([b.features[key].lengths() for b in batches]) for key in keys]
        features = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=torch.cat(values), lengths=torch.cat(lengths))
        return replace(first, features=features, host_lengths=None)


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
