"""The sparse part: a TorchRec EmbeddingCollection sharded by DistributedModelParallel, driven through the
sharded module's own input-dist / compute-and-output-dist API so that each phase is one engine task.

No FX tracing of the user's model: the module calls these three methods from its task hooks.
"""

import datetime
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torchrec
from torchrec import EmbeddingCollection, EmbeddingConfig
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.dist_data import KJTAllToAll
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.planner.storage_reservations import FixedPercentageStorageReservation
from torchrec.distributed.types import BoundsCheckMode, CacheParams, ShardingEnv, ShardingType
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from .. import known_warnings  # noqa: F401  (TorchRec's lookups ask torch.fx whether they are traced)
from . import recat
from .batch import check_ids

TABLES_AHEAD = "hstu_tables_ahead"
"""A checkpoint entry: [epoch, batch] when the checkpoint was saved after that batch's step failed between
backward (where the tables' fused optimizer applied the batch) and the dense optimizer step. A module with
``ShardedEmbeddings`` sets it; ``HSTUPipelineStrategy`` refuses to train on from such a checkpoint (the batch
would be applied to the tables twice)."""

INPUT_DIST_GROUPS = ("world", "own")
"""The process group of the tables' input all-to-alls (``ShardedEmbeddings(input_dist_group=...)``): "world",
TorchRec's, the step's group, which also runs the output all-to-alls and megatron-core's gradient all-reduce;
"own", a group of the same ranks for them alone. NCCL runs a group's collectives one after another on one
stream, in the order they were issued: on the step's group a batch's input all-to-alls, issued steps ahead by
the data_dist task, queue behind the collectives the compute thread issued before them, and
``wait_input_dist``'s host wait for the splits waits for those too (and, holding the collective ticket, keeps the
compute thread's next collective waiting); on a group of their own they wait for each other only. The same
values either way. The engine's tickets give every collective task one launch order, the same on every rank,
over both groups: what NCCL asks of communicators used at the same time (the balanced shuffler's all-gathers
have a group of their own for the same reason)."""


def check_input_dist_group(input_dist_group: str) -> None:
    """Refuses a value not in ``INPUT_DIST_GROUPS``, naming the valid ones (before any process group is made)."""
    if input_dist_group not in INPUT_DIST_GROUPS:
        raise ValueError(f"unknown input_dist_group {input_dist_group!r}; valid: {', '.join(INPUT_DIST_GROUPS)}")


@dataclass
class InputDist:
    """One batch between start_input_dist and compute_output_dist: its own TorchRec context (never shared
    between batches) and the awaitable of its input all-to-alls, or their result."""

    context: Any
    pending: Any


class ShardedEmbeddings(torch.nn.Module):
    """Embedding tables sharded over every rank, updated by a fused optimizer during backward.

    ``sharding_type`` None: row-wise over several ranks; on one rank, table-wise, which keeps the same one
    shard per table (the same state dict) and skips the row-wise input distribution's bucketize of every
    id by its row (fbgemm's kernel and its Python, 5% of a host-bound step's host time on an H200).
    ``input_dist_group``: where the input all-to-alls run (``INPUT_DIST_GROUPS``); ``timeout``: that group's
    collectives' (the strategy's ``process_group_timeout``; None: torch's default)."""

    def __init__(
        self,
        tables: Sequence[EmbeddingConfig],
        device: torch.device,
        *,
        optimizer: type[torch.optim.Optimizer] = torch.optim.SGD,
        optimizer_kwargs: dict | None = None,
        sharding_type: ShardingType | None = None,
        cache_load_factor: float | None = None,
        input_dist_group: str = "world",
        timeout: datetime.timedelta | None = None,
    ):
        super().__init__()
        check_input_dist_group(input_dist_group)
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("ShardedEmbeddings needs torch.distributed initialised (the strategy does it)")
        if cache_load_factor is not None and (device.type != "cuda" or not 0 < cache_load_factor <= 1):
            raise ValueError(
                f"cache_load_factor={cache_load_factor!r} on {device}: an embedding cache keeps a "
                f"fraction (0, 1] of each table in GPU memory, the rest in host memory (UVM), "
                f"with fbgemm-gpu's CUDA kernels; use None on CPU"
            )
        recat.memoize()  # the input distribution's per-batch index, without a wait for the GPU each step
        collection = EmbeddingCollection(tables=list(tables), device=torch.device("meta"))
        apply_optimizer_in_backward(optimizer, collection.parameters(), optimizer_kwargs or {"lr": 0.05})
        world = dist.get_world_size()
        if sharding_type is None:
            sharding_type = ShardingType.TABLE_WISE if world == 1 else ShardingType.ROW_WISE
        planner = EmbeddingShardingPlanner(
            topology=_topology(world, device.type),
            # a fixed share of each device's memory kept for the dense part and activations: TorchRec's
            # default (heuristic) reservation estimates the dense tensors, and says it misjudges them
            storage_reservation=FixedPercentageStorageReservation(percentage=0.15),
            constraints={t.name: _constraints(sharding_type, cache_load_factor) for t in tables},
        )
        plan = planner.collective_plan(collection, [EmbeddingCollectionSharder()], dist.GroupMember.WORLD)
        self.model_parallel = DistributedModelParallel(
            collection,
            device=device,
            plan=plan,
            env=ShardingEnv.from_process_group(dist.GroupMember.WORLD),
            init_data_parallel=False,
        )  # dense gradients are megatron-core's business, not torch DDP's
        self._register_load_state_dict_pre_hook(_unwrapped_keys_to_wrapped)
        self.input_group = _own_input_group(self.sharded, timeout) if input_dist_group == "own" else None
        """The input all-to-alls' own process group (``input_dist_group="own"`` on several ranks), else None."""
        self.rows = {feature: t.num_embeddings for t in tables for feature in t.feature_names}
        """Each feature's table size: ids must be in ``0 .. rows - 1``."""
        self._prefetched = 0  # batches prefetched whose lookup has not run yet
        self._prefetched_lock = threading.Lock()  # prefetch and lookup run on different engine threads

    @property
    def sharded(self) -> Any:
        return self.model_parallel.module

    def input_groups(self) -> list[Any]:
        """The process group of each of the input distributions' all-to-alls (TorchRec's ``KJTAllToAll``)."""
        return [alltoall._pg for alltoall in _input_alltoalls(self.sharded)]

    def local_weights(self) -> dict[str, torch.Tensor]:
        """Each table's shard on this rank (views of the live weights: copy_ into them restores them)."""
        return {name: weight.local_shards()[0].tensor for name, weight in self.model_parallel.state_dict().items()}

    def state_dict(self, *, destination=None, prefix: str = "", keep_vars: bool = False):
        # DistributedModelParallel.state_dict prefixes every key of the destination it is given, so below a
        # parent module it would rename the parent's other entries too: fill a dict of its own, then copy.
        destination = OrderedDict() if destination is None else destination
        for key, value in self.model_parallel.state_dict(keep_vars=keep_vars).items():
            destination[f"{prefix}model_parallel.{key}"] = value
        return destination

    def forward(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        """All phases at once (evaluation, or outside the engine)."""
        if self._prefetched:
            # fbgemm's lookup takes the oldest prefetched cache locations, whichever batch it looks up
            raise RuntimeError(
                f"an embedding lookup outside the engine while {self._prefetched} prefetched "
                f"training batch(es) wait for theirs: the embedding cache would give it their "
                f"rows. With cache_load_factor set, validate at the end of an epoch "
                f"(val_check_interval=1.0), or use cache_load_factor=None"
            )
        self._check_ids(features)
        return self.model_parallel(features)

    def start_input_dist(self, features: KeyedJaggedTensor) -> InputDist:
        self._check_ids(features)
        context = self.sharded.create_context()
        return InputDist(context, self.sharded.input_dist(context, features))

    def wait_input_dist(self, started: InputDist) -> InputDist:
        # The first wait is the splits all-to-all (it blocks the host), the second the ids all-to-all.
        return InputDist(started.context, started.pending.wait().wait())

    def _check_ids(self, features: KeyedJaggedTensor) -> None:
        # Ids in host memory are checked here, with the feature and table named. On a GPU that check would
        # wait for the device every step: there fbgemm's own bounds check stops at a bad id (FATAL, set
        # in _constraints) instead of looking up row 0, and data modules check their batches as they
        # build them (HistoryDataModule does).
        if features.values().device.type == "cpu":
            check_ids(features, self.rows)

    @property
    def needs_prefetch(self) -> bool:
        """Whether a table keeps an embedding cache whose rows must be fetched before the lookup."""
        return any(getattr(lookup, "_need_prefetch", False) for lookup in self.sharded._lookups)

    def prefetch(self, waited: InputDist, forward_stream: torch.cuda.Stream | None) -> None:
        """Load the rows a batch looks up into the cache (from host memory), ahead of its lookup, which runs
        on ``forward_stream``. Batches must be prefetched in the order they are looked up: fbgemm queues
        the cache locations of each prefetch and the lookup takes the oldest."""
        self.sharded.prefetch(waited.pending, forward_stream=forward_stream, ctx=waited.context)
        with self._prefetched_lock:
            self._prefetched += 1

    def compute_output_dist(self, waited: InputDist) -> dict[str, JaggedTensor]:
        if self._prefetched:
            with self._prefetched_lock:
                self._prefetched -= 1
        return self.sharded.compute_and_output_dist(waited.context, waited.pending).wait()


def _input_alltoalls(sharded: Any) -> list[KJTAllToAll]:
    return [m for input_dist in sharded._input_dists for m in input_dist.modules() if isinstance(m, KJTAllToAll)]


def _own_input_group(sharded: Any, timeout: datetime.timedelta | None) -> Any:
    """A process group of every rank, given to each ``KJTAllToAll`` of the sharded collection's input
    distributions (``INPUT_DIST_GROUPS``) as TorchRec creates them, at the first batch; None on one rank,
    where no all-to-all leaves the rank. Called on every rank in the same order (it is a collective)."""
    if dist.get_world_size() == 1:
        return None
    create = getattr(sharded, "_create_input_dist", None)
    if create is None or not getattr(sharded, "_has_uninitialized_input_dist", False):
        raise RuntimeError(
            f"input_dist_group='own': TorchRec {torchrec.__version__} does not create its input distributions "
            f"where this version looks (_create_input_dist at the first batch); use input_dist_group='world'"
        )
    group = dist.new_group(timeout=timeout)

    def create_on_own_group(*args, **kwargs):
        create(*args, **kwargs)
        alltoalls = _input_alltoalls(sharded)
        if not alltoalls or not all(isinstance(getattr(a, "_pg", None), dist.ProcessGroup) for a in alltoalls):
            raise RuntimeError(
                f"input_dist_group='own': TorchRec {torchrec.__version__} does not keep its input all-to-alls' "
                f"process group where this version looks (KJTAllToAll._pg); use input_dist_group='world'"
            )
        for alltoall in alltoalls:
            alltoall._pg = group

    sharded._create_input_dist = create_on_own_group  # TorchRec calls it once, before the first all-to-all
    return group


def _topology(world: int, compute_device: str) -> Topology:
    """The planner's topology, through TorchRec's factory where it has one (a Topology made directly makes
    newer TorchRec warn that hardware settings are not resolved)."""
    try:
        from torchrec.distributed.planner.types import KernelConfig, TopologyFactory, TrainerConfig
    except ImportError:  # an older TorchRec: no factory
        return Topology(world_size=world, compute_device=compute_device)
    return TopologyFactory.create_topology(
        trainer_config=TrainerConfig(world_size=world), kernel_config=KernelConfig(compute_device=compute_device)
    )


def _constraints(sharding_type: ShardingType, cache_load_factor: float | None) -> ParameterConstraints:
    # FATAL: an id outside its table raises (CPU) or asserts on the device (CUDA); fbgemm's default
    # (WARNING) logs one line and looks the id up as row 0, so training goes on with wrong data.
    if cache_load_factor is None:
        return ParameterConstraints(sharding_types=[sharding_type.value], bounds_check_mode=BoundsCheckMode.FATAL)
    # prefetch_pipeline: fbgemm keeps the rows of prefetched batches locked in the cache until their
    # backward, so the prefetch of the next batch may run before this one's backward.
    return ParameterConstraints(
        sharding_types=[sharding_type.value],
        compute_kernels=[EmbeddingComputeKernel.FUSED_UVM_CACHING.value],
        cache_params=CacheParams(load_factor=cache_load_factor, prefetch_pipeline=True),
        bounds_check_mode=BoundsCheckMode.FATAL,
    )


def _unwrapped_keys_to_wrapped(state_dict, prefix, *args) -> None:
    """DistributedModelParallel's state_dict leaves its wrapper out of the keys (``model_parallel.embeddings.
    item.weight``) and only its own ``load_state_dict`` puts it back; loaded through a parent module (as
    Lightning does), the sharded collection's hooks look for ``model_parallel._dmp_wrapped_module....``."""
    outer, inner = f"{prefix}model_parallel.", f"{prefix}model_parallel._dmp_wrapped_module."
    for key in [k for k in state_dict if k.startswith(outer) and not k.startswith(inner)]:
        state_dict[inner + key[len(outer) :]] = state_dict.pop(key)
