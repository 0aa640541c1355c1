"""Data parallelism of the dense part through megatron-core: its DistributedDataParallel collects gradients
into contiguous buckets, and ``finalize_model_grads`` all-reduces them (the finalize_model_grads task).

The sparse part (TorchRec embeddings) is not here: its fused optimizer updates it during backward.
"""

import contextlib
import math
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from .. import known_warnings  # noqa: F401  (before megatron-core is imported)


class MegatronDenseGrads:
    """Wraps ``module`` in megatron-core's DDP over the default process group (one data-parallel group).

    Per step: ``zero_grad()`` before backward, then ``finalize()`` after it; ``finalize`` leaves each
    parameter's ``.grad`` pointing at its all-reduced mean gradient, so any torch optimizer can step.
    On one rank there is nothing to reduce: ``finalize`` only points the ``.grad`` at megatron's buffers
    (whose fixed addresses the captured optimizer step needs), without ``finalize_model_grads``'s walk over
    the parameters and its all-reduce of the bucket with itself.
    """

    def __init__(self, module: nn.Module, *, bucket_size: int | None = None, timeout: timedelta | None = None):
        from megatron.core import parallel_state
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.transformer import TransformerConfig

        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("megatron-core's DistributedDataParallel needs torch.distributed initialised")
        if not parallel_state.model_parallel_is_initialized():
            # data parallel over every rank; its groups time out like the strategy's (whole minutes here)
            minutes = (
                {} if timeout is None else {"distributed_timeout_minutes": math.ceil(timeout.total_seconds() / 60)}
            )
            parallel_state.initialize_model_parallel(1, 1, **minutes)
        # megatron asks for a TransformerConfig, of which DDP reads only generic fields
        config = TransformerConfig(
            num_layers=1, hidden_size=1, num_attention_heads=1, cuda_graph_scope=[]
        )  # [] means the whole layer; its default "full" is deprecated
        ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=False, bucket_size=bucket_size)
        device = next(module.parameters()).device
        with _buffers_on(device):
            self.ddp = DistributedDataParallel(config, ddp_config, module)
        self.module = module
        self._params = list(module.parameters())
        self._ranks = parallel_state.get_data_parallel_world_size()

    def zero_grad(self) -> None:
        self.ddp.zero_grad_buffer()
        for p in self._params:
            p.grad = None

    def accumulators(self) -> dict[nn.Parameter, torch.Tensor]:
        """Each trained parameter's slot in megatron's buffers (``main_grad``), where a gradient may be added
        in place of reaching ``.grad``: with ``overlap_grad_reduce`` off, as here, megatron's per-parameter
        hook does nothing else with it (``GraphedMethod`` adds the replayed backward's gradients there)."""
        return {p: p.main_grad for p in self._params if p.requires_grad}

    def finalize(self) -> None:
        from megatron.core.distributed import finalize_model_grads

        if self._ranks > 1:
            finalize_model_grads([self.ddp])
        for p in self._params:
            if p.requires_grad:
                p.grad = p.main_grad  # a view into megatron's bucket: no copy


@contextlib.contextmanager
def _buffers_on(device: torch.device) -> Iterator[None]:
    """megatron-core allocates its gradient buffers on ``torch.cuda.current_device()``, which raises on a
    CPU build; point it at the module's device while wrapping."""
    if device.type == "cuda":
        yield
        return
    original = torch.cuda.current_device
    torch.cuda.current_device = lambda: device
    try:
        yield
    finally:
        torch.cuda.current_device = original
