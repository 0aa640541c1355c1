"""The sparse part: a TorchRec EmbeddingCollection sharded by DistributedModelParallel, driven through the
sharded module's own input-dist / compute-and-output-dist API so that each phase is one engine task.

No FX tracing of the user's model: the module calls these three methods from its task hooks.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torchrec import EmbeddingCollection, EmbeddingConfig
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.types import ShardingEnv, ShardingType
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor


@dataclass
class InputDist:
    """One batch between start_input_dist and compute_output_dist: its own TorchRec context (never shared
    between batches) and the awaitable of its input all-to-alls, or their result."""

    context: Any
    pending: Any


class ShardedEmbeddings(torch.nn.Module):
    """Embedding tables sharded row-wise over every rank, updated by a fused optimizer during backward."""

    def __init__(self, tables: Sequence[EmbeddingConfig], device: torch.device, *,
                 optimizer: type[torch.optim.Optimizer] = torch.optim.SGD, optimizer_kwargs: dict | None = None,
                 sharding_type: ShardingType = ShardingType.ROW_WISE):
        super().__init__()
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("ShardedEmbeddings needs torch.distributed initialised (the strategy does it)")
        collection = EmbeddingCollection(tables=list(tables), device=torch.device("meta"))
        apply_optimizer_in_backward(optimizer, collection.parameters(), optimizer_kwargs or {"lr": 0.05})
        world = dist.get_world_size()
        planner = EmbeddingShardingPlanner(
            topology=Topology(world_size=world, compute_device=device.type),
            constraints={t.name: ParameterConstraints(sharding_types=[sharding_type.value]) for t in tables})
        plan = planner.collective_plan(collection, [EmbeddingCollectionSharder()], dist.GroupMember.WORLD)
        self.model_parallel = DistributedModelParallel(
            collection, device=device, plan=plan, env=ShardingEnv.from_process_group(dist.GroupMember.WORLD),
            init_data_parallel=False)  # dense gradients are megatron-core's business, not torch DDP's

    @property
    def sharded(self) -> Any:
        return self.model_parallel.module

    def local_weights(self) -> dict[str, torch.Tensor]:
        """Each table's shard on this rank (views of the live weights: copy_ into them restores them)."""
        return {name: weight.local_shards()[0].tensor for name, weight in self.model_parallel.state_dict().items()}

    def forward(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        """All phases at once (evaluation, or outside the engine)."""
        return self.model_parallel(features)

    def start_input_dist(self, features: KeyedJaggedTensor) -> InputDist:
        context = self.sharded.create_context()
        return InputDist(context, self.sharded.input_dist(context, features))

    def wait_input_dist(self, started: InputDist) -> InputDist:
        # The first wait is the splits all-to-all (it blocks the host), the second the ids all-to-all.
        return InputDist(started.context, started.pending.wait().wait())

    def compute_output_dist(self, waited: InputDist) -> dict[str, JaggedTensor]:
        return self.sharded.compute_and_output_dist(waited.context, waited.pending).wait()
