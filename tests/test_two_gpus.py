"""Two ranks on two GPUs over NCCL, each rank its own process on the CUDA device of its local rank: the same
results as the single-threaded legacy_none, as Lightning's own DDP and as the run that never stopped.

- the HSTU stack (TorchRec tables sharded over both GPUs, the balanced shuffler, megatron-core gradients,
  the fused attention; graph capture on and off) trains under every preset to legacy_none's dense weights
  and table shards, also with random delays injected into the tasks on both ranks, and with the tables'
  input all-to-alls on a process group of their own; with the engine's
  cross-stream event waits switched off, the delayed runs differ (the delays can make the test fail);
- an ordinary LightningModule trains under every preset like Lightning's own DDP on the two GPUs;
- the collective inventory records every collective of a step with its NCCL process group and CUDA
  stream, the ranks launch the same ones in the same order, and a rank that launches one more is reported;
- a sharded checkpoint written on the two GPUs resumes mid-epoch to the uninterrupted run, and loads on one;
- a rank with fewer batches ends the epoch for both.

Skipped unless there are two CUDA devices, NCCL and fbgemm-gpu's CUDA build (TorchRec's GPU kernels). With
LIGHTNING_HSTU_TWO_RANK_BACKEND=gloo the same checks run on two CPU processes over gloo instead, for
developing them without GPUs, less what needs a GPU: graph capture, the test of the event waits and the
inventory's NCCL columns. Each check launches its scripts (tests/scripts/) as a new multi-process job and
reads what every rank saved. See docs/two-gpus.md.
"""

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ranks import run_script

from lightning_hstu import PRESET_NAMES

BACKEND_VARIABLE = "LIGHTNING_HSTU_TWO_RANK_BACKEND"
BACKENDS = ("nccl", "gloo")
BACKEND = os.environ.get(BACKEND_VARIABLE, "nccl")
if BACKEND not in BACKENDS:
    raise ValueError(f"{BACKEND_VARIABLE}={BACKEND!r}; valid: {', '.join(BACKENDS)} (unset means nccl)")
GPU = BACKEND == "nccl"
ACCELERATOR = "gpu" if GPU else "cpu"

SCRIPTS = Path(__file__).parent / "scripts"
STEPS = 6
"""Steps of the HSTU preset runs: the graphs are captured after 3 and replayed for the other 3."""
LAUNCH_TIMEOUT_S = 600 if GPU else 1800  # the two CPU processes of the gloo mode share a small machine


def missing_for_two_gpus() -> list[str]:
    missing = []
    if torch.cuda.device_count() < 2:
        missing.append(f"two CUDA devices (found {torch.cuda.device_count()})")
    if not dist.is_nccl_available():
        missing.append("NCCL")
    if not _fbgemm_has_cuda_kernels():
        missing.append("fbgemm-gpu's CUDA build (TorchRec's GPU kernels)")
    return missing


def _fbgemm_has_cuda_kernels() -> bool:
    try:
        import fbgemm_gpu  # noqa: F401  (registers its operators)
    except (ImportError, OSError):
        return False
    return torch._C._dispatch_has_kernel_for_dispatch_key("fbgemm::asynchronous_complete_cumsum", "CUDA")


MISSING = missing_for_two_gpus() if GPU else []
pytestmark = pytest.mark.skipif(
    bool(MISSING),
    reason=f"needs {', '.join(MISSING)}; {BACKEND_VARIABLE}=gloo runs these checks on two CPU processes instead",
)
gpu_only = pytest.mark.skipif(not GPU, reason=f"needs the GPUs ({BACKEND_VARIABLE}=gloo runs on CPU processes)")

GPU_TOLERANCE = dict(rtol=1e-4, atol=1e-5)
"""On the GPUs a run is not bitwise repeatable: some kernels sum with atomic adds, in an order that changes
from run to run (the relative-bias gradients of the fused attention, and index_add_ in the padded one, for
two). Weights of two runs are equal up to that summation order (as in test_hstu_cuda.py); on CPU, bitwise."""


class Launch:
    """One launch of a script on two ranks; ``[name]`` is what each rank saved as ``<name>.rank<R>.pt``."""

    def __init__(self, script: str, out: Path, *args):
        out.mkdir(parents=True, exist_ok=True)
        self.out = out
        self.result = run_script(SCRIPTS / script, out, *args, timeout=LAUNCH_TIMEOUT_S)

    def __getitem__(self, name: str) -> list[dict]:
        paths = [self.out / f"{name}.rank{rank}.pt" for rank in (0, 1)]
        if not all(p.is_file() for p in paths):
            pytest.fail(
                f"{name}: no result from every rank; the launch ended with exit code "
                f"{self.result.returncode}:\n{self.result.stderr[-4000:]}"
            )
        return [torch.load(p, weights_only=False) for p in paths]


def differences(got: dict, expected: dict) -> list[str]:
    """The tensors of ``expected`` that ``got`` does not equal (on the GPUs: is not close to)."""
    if got.keys() != expected.keys():
        return [f"names {sorted(got)} != {sorted(expected)}"]
    found = []
    for name, value in expected.items():
        same = torch.allclose(got[name], value, **GPU_TOLERANCE) if GPU else torch.equal(got[name], value)
        if not same:
            found.append(f"{name} (by up to {(got[name].double() - value.double()).abs().max():.3g})")
    return found


def assert_same(got: dict, expected: dict) -> None:
    found = differences(got, expected)
    assert not found, f"differ: {', '.join(found)}"


def training_differences(got: list[dict], expected: list[dict]) -> list[str]:
    """Rank by rank, the dense weights and the table shards of two HSTU runs that differ."""
    return [
        f"rank {rank} {part} {name}"
        for rank, (g, e) in enumerate(zip(got, expected))
        for part in ("dense", "sparse")
        for name in differences(g[part], e[part])
    ]


def assert_replicas_equal(ranks: list[dict], key: str) -> None:
    """Data parallelism keeps the two ranks' copies of the dense weights bitwise equal, on the GPUs too."""
    first, second = ranks[0][key], ranks[1][key]
    assert first.keys() == second.keys()
    for name, value in first.items():
        assert torch.equal(second[name], value), f"the ranks' {name} differ"


# ----- 1. the HSTU stack under every preset, legacy_none's weights -------------------------------------------

INPUT_GROUP_PRESETS = ("legacy_none", "full_split_d6")
"""Presets run with the tables' input all-to-alls on a process group of their own (``input_dist_group="own"``)."""

MUTATED = ("default_d6", "full_split_d6")
"""Presets whose delayed runs are repeated with the event waits off. Under them start_input_dist (data_dist
stream) reads the shuffled batch in the step in which finish_shuffle (memcpy stream) made it, with no host
wait for the memcpy stream in between, so only the event makes it wait for the ids written late."""


def preset_runs() -> list[str]:
    """The runs of one launch (see hstu_presets.py), in the order they run: a run that fails stops the launch
    and leaves the results of the runs before it, so the eager runs come first and the graph captures last."""
    runs = ["legacy_none", *PRESET_NAMES[1:], *(f"{preset}+delays" for preset in PRESET_NAMES)]
    runs += [f"{preset}+inputgroup+delays" for preset in INPUT_GROUP_PRESETS]
    if GPU:
        runs += [f"{preset}+delays+nowaits" for preset in MUTATED]
        runs += ["legacy_none+graphs", *(f"{preset}+graphs+delays" for preset in PRESET_NAMES)]
    return runs


@pytest.fixture(scope="module")
def hstu_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("hstu_presets")
    return Launch("hstu_presets.py", out, out, STEPS, *preset_runs(), "--accelerator", ACCELERATOR)


def assert_trains_like(got: list[dict], expected: list[dict]) -> None:
    for rank in (*got, *expected):
        assert rank["global_step"] == STEPS
    found = training_differences(got, expected)
    assert not found, f"differ: {', '.join(found)}"
    assert_replicas_equal(got, "dense")


@pytest.mark.parametrize("preset", PRESET_NAMES[1:])
def test_every_preset_trains_the_hstu_stack_to_legacy_nones_weights(preset, hstu_runs):
    assert_trains_like(hstu_runs[preset], hstu_runs["legacy_none"])


@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_random_delays_on_both_ranks_change_no_weight(preset, hstu_runs):
    assert_trains_like(hstu_runs[f"{preset}+delays"], hstu_runs["legacy_none"])


@pytest.mark.parametrize("preset", INPUT_GROUP_PRESETS)
def test_input_all_to_alls_on_a_group_of_their_own_train_to_legacy_nones_weights(preset, hstu_runs):
    """input_dist_group="own": the input all-to-alls on their own NCCL group (their own stream), issued by the
    data_dist task steps ahead of the compute thread's collectives, with random delays on both ranks."""
    runs = hstu_runs[f"{preset}+inputgroup+delays"]
    assert_trains_like(runs, hstu_runs["legacy_none"])
    for rank in runs:
        assert rank["input_groups"] and set(rank["input_groups"]) == {"own"}


@gpu_only
@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_the_graph_captured_dense_part_with_delays_trains_to_legacy_nones_weights(preset, hstu_runs):
    """Padded attention: one graph per rank, captured after 3 eager steps, replayed for the others; the
    reference is legacy_none on its own graphs."""
    runs, reference = hstu_runs[f"{preset}+graphs+delays"], hstu_runs["legacy_none+graphs"]
    assert_trains_like(runs, reference)
    for rank in (*runs, *reference):
        assert rank["graphs"] == {"eager_calls": 3, "replays": STEPS - 3, "graphs": 1}


@gpu_only
@pytest.mark.parametrize("preset", MUTATED)
def test_without_the_event_waits_the_delayed_runs_differ(preset, hstu_runs):
    """The test of the tests above: the delays make a consumer that does not wait for its producer's CUDA
    event read unfinished ids, and the weights show it."""
    legacy = hstu_runs["legacy_none"]
    assert_trains_like(hstu_runs[f"{preset}+delays"], legacy)
    assert training_differences(hstu_runs[f"{preset}+delays+nowaits"], legacy), (
        "without the event waits the delayed runs still equal legacy_none's: the delays expose no missing wait"
    )


# ----- 2. an ordinary LightningModule, Lightning's own DDP ---------------------------------------------------


@pytest.fixture(scope="module")
def toy_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("toy")
    return Launch(
        "fit_two_ranks.py", out, out, "ddp", *[f"hstu_{p}" for p in PRESET_NAMES], "--accelerator", ACCELERATOR
    )


@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_every_preset_trains_an_ordinary_module_like_lightnings_ddp(preset, toy_runs):
    ranks, ddp = toy_runs[f"hstu_{preset}"], toy_runs["ddp"]
    for got, expected in zip(ranks, ddp):
        assert got["seen"] == expected["seen"]  # each rank trained its DistributedSampler share, in order
        assert got["global_step"] == expected["global_step"] == 16
        assert_same(got["weights"], expected["weights"])
    assert_replicas_equal(ranks, "weights")


# ----- 3. the collective inventory on two NCCL ranks ---------------------------------------------------------

INVENTORY_STEPS = 12
"""hstu_ranks.py records and compares the collectives of steps 5, 6 and 11 (near an epoch's end, a step
runs only the tasks whose batch is still in the epoch: together these steps run every task)."""

COLLECTIVES = {
    "start_shuffle": {"allgather"},  # every rank's feature lengths (the shuffler's gloo group, host memory)
    "finish_shuffle": {"allgather"},  # every rank's values
    "start_input_dist": {"alltoall"},  # TorchRec's splits
    "wait_input_dist": {"alltoall"},  # the ids
    "global_tokens_allreduce": {"allreduce"},
    "compute_output_dist": {"alltoall"},  # the looked-up rows
    "forward": {"allreduce"},  # every rank's loss finite? (the strategy's gloo group)
    "backward": {"alltoall"},  # the rows' gradients (on a GPU launched by autograd's own thread)
    "finalize_model_grads": {"allreduce"},  # megatron-core's dense gradients
}
"""What each task of the HSTU workload launches on two ranks."""


@pytest.fixture(scope="module")
def inventory_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("inventory")
    launch = Launch("hstu_ranks.py", out, "full_split_d6", out, INVENTORY_STEPS, "--accelerator", ACCELERATOR)
    assert launch.result.returncode == 0, launch.result.stderr[-4000:]
    return [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in (0, 1)]


def recorded(rank: dict) -> list[dict]:
    """The collectives of every recorded step of a rank."""
    return [collective for inventory in rank["inventories"] for collective in inventory]


def test_the_ranks_launch_the_same_collectives_and_the_inventory_records_each(inventory_run):
    for rank in inventory_run:
        assert rank["global_step"] == INVENTORY_STEPS
        assert rank["compared"] == len(rank["inventories"]) == 3  # the ranks exchanged them and found them equal
        launched = {}
        for collective in recorded(rank):
            launched.setdefault(collective["task"], set()).add(collective["operation"])
            assert collective["payload_bytes"] is not None, collective
        assert launched == COLLECTIVES
    assert_replicas_equal(inventory_run, "weights")


@gpu_only
def test_every_nccl_collective_is_recorded_with_its_process_group_and_stream(inventory_run):
    for rank in inventory_run:
        # forward's and start_shuffle's run on gloo groups, in host memory
        on_nccl = [c for c in recorded(rank) if c["task"] not in ("forward", "start_shuffle")]
        assert on_nccl and all(c["process_group"] and c["stream"] is not None for c in on_nccl), on_nccl
        # megatron-core reduces on a data-parallel group of its own, the tasks' collectives use the default one
        groups = {c["task"]: c["process_group"] for c in on_nccl}
        assert groups["finalize_model_grads"] != groups["global_tokens_allreduce"]


def test_a_rank_that_launches_one_collective_more_is_reported(tmp_path):
    launch = Launch(
        "hstu_ranks.py", tmp_path, "default_d6", tmp_path, INVENTORY_STEPS, "--mismatch", "--accelerator", ACCELERATOR
    )
    assert launch.result.returncode != 0
    assert "collectives differ between ranks" in launch.result.stderr
    assert "rank 1 ('finish_shuffle'" in launch.result.stderr and "'allreduce')" in launch.result.stderr


# ----- 4. sharded checkpoints ------------------------------------------------------------------------------


def resume_run(out: Path, *args, devices: int = 2) -> list[dict]:
    launch = Launch("hstu_resume.py", out, out, STEPS, "--devices", devices, "--accelerator", ACCELERATOR, *args)
    assert launch.result.returncode == 0, launch.result.stderr[-4000:]
    return [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(devices)]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Six steps (mid-epoch: each rank has more batches an epoch), a checkpoint every three."""
    out = tmp_path_factory.mktemp("uninterrupted")
    return out, resume_run(out, "--save-every", 3, "--state-at", 3)


def test_a_checkpoint_resumed_mid_epoch_gives_the_uninterrupted_run(uninterrupted, tmp_path):
    out, expected = uninterrupted
    resumed = resume_run(tmp_path / "resumed", "--resume", out / "step=3.ckpt", "--state-at", 3)
    for rank, (got, want) in enumerate(zip(resumed, expected)):
        assert got["global_step"] == want["global_step"] == STEPS
        assert got["users"] == want["users"][3:], rank  # the same batches, in the same order
        for part in ("model", "sparse_optimizer"):  # the state read back is the state written, bitwise
            assert got["state_at"][part].keys() == want["state_at"][part].keys()
            for name, value in want["state_at"][part].items():
                assert torch.equal(got["state_at"][part][name], value), (rank, part, name)
            assert_same(got["state"][part], want["state"][part])
        if GPU:
            torch.testing.assert_close(got["losses"], want["losses"][3:], **GPU_TOLERANCE)
        else:
            assert got["losses"] == want["losses"][3:], rank


def test_the_checkpoint_of_two_ranks_loads_on_one(uninterrupted, tmp_path):
    out, two_ranks = uninterrupted
    (one_rank,) = resume_run(tmp_path / "one", "--resume", out / f"step={STEPS}.ckpt", devices=1)
    assert one_rank["losses"] == []  # nothing left to train
    loaded, saved = one_rank["state"]["model"], [rank["state"]["model"] for rank in two_ranks]
    assert loaded.keys() == saved[0].keys()
    for name, value in loaded.items():
        if name.startswith("embeddings."):  # a table: row-wise, rank 0 held the first rows
            assert torch.equal(value, torch.cat([rank[name] for rank in saved])), name
        else:
            assert torch.equal(value, saved[0][name]), name


# ----- 5. uneven data --------------------------------------------------------------------------------------


def test_a_rank_with_fewer_batches_ends_the_epoch_for_both(tmp_path):
    ranks = Launch(
        "fit_two_ranks.py", tmp_path, tmp_path, "hstu_full_split_d6", "--data", "uneven", "--accelerator", ACCELERATOR
    )["hstu_full_split_d6"]
    for rank in ranks:
        assert rank["global_step"] == 2 * 6  # both stop at rank 1's 6 batches, each epoch
        assert [idx for idx, _ in rank["seen"]] == list(range(6)) * 2
    assert_replicas_equal(ranks, "weights")
