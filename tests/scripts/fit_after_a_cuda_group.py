"""A CPU fit in a process whose default process group has no backend for CPU tensors, as an earlier GPU run's
NCCL group leaves it (here a gloo backend for CUDA tensors only, which a machine without a GPU can make)."""

import sys
import tempfile
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from lightning_runs import fit  # noqa: E402

from lightning_hstu import HSTUPipelineStrategy  # noqa: E402

init = Path(tempfile.mkdtemp()) / "init"
dist.init_process_group("cuda:gloo", init_method=f"file://{init}", rank=0, world_size=1)
try:
    fit(HSTUPipelineStrategy("legacy_none"), max_epochs=1)
finally:
    dist.destroy_process_group()
