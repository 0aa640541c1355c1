"""The HSTU workload on two gloo ranks under several presets, for a hundred steps, with the debug mode
that compares every rank's collective sequence (CollectiveInventoryCallback(compare_ranks=True)): the ranks
launch the same collectives in the same order, finish, and agree on the dense weights; a rank that
launches one collective more is reported, by every rank, instead of hanging them."""

import math
from pathlib import Path

import pytest
import torch

from ranks import run_script

SCRIPT = Path(__file__).parent / "scripts" / "hstu_ranks.py"
STEPS = 100


def run(preset, out_dir, *args):
    out_dir.mkdir()
    return run_script(SCRIPT, out_dir, preset, out_dir, STEPS, *args, timeout=300)


HUNDRED_STEP_PRESETS = ["legacy_none", "per_task_d3", "full_split_d6"]


@pytest.fixture(scope="module")
def hundred_steps(tmp_path_factory):
    """The three presets' hundred-step fits, one after the other in one launch of two ranks."""
    out = tmp_path_factory.mktemp("hundred_steps") / "out"
    out.mkdir()
    result = run_script(SCRIPT, out, ",".join(HUNDRED_STEP_PRESETS), out, STEPS, timeout=600)
    return result, out


@pytest.mark.parametrize("preset", HUNDRED_STEP_PRESETS)
def test_ranks_launch_the_same_collectives_for_a_hundred_steps(preset, hundred_steps):
    result, out = hundred_steps
    saved = [out / f"{preset}.rank{r}.pt" for r in (0, 1)]
    assert all(path.exists() for path in saved), f"{preset} did not finish:\n{result.stderr[-3000:]}"
    assert result.returncode == 0, result.stderr[-3000:]  # and the launch ended cleanly after the three fits
    ranks = [torch.load(path, weights_only=False) for path in saved]
    for rank in ranks:
        assert rank["global_step"] == STEPS
        assert rank["compared"] == 3
    for name, value in ranks[0]["weights"].items():  # megatron-core's all-reduce keeps the replicas equal
        assert torch.equal(ranks[1]["weights"][name], value), name


def test_a_rank_that_launches_one_collective_more_is_reported(tmp_path):
    result = run("default_d6", tmp_path / "out", "--mismatch")
    assert result.returncode != 0
    assert "collectives differ between ranks" in result.stderr
    assert "rank 1 ('finish_shuffle'" in result.stderr and "'allreduce')" in result.stderr


def test_validate_and_test_on_two_ranks_keep_each_ranks_table_shards(tmp_path):
    """trainer.validate and trainer.test after fit, on two ranks: before them Lightning's DDP broadcasts the
    module's states from rank 0 (no DDP wrapper outside fit); the sharded tables are left out of it, so each
    rank keeps its own shard (before, the broadcast failed on shards of different sizes, and would have
    copied rank 0's shard over the others on shards of equal size), and both ranks report the same metrics."""
    out = tmp_path / "out"
    out.mkdir()
    result = run_script(SCRIPT.parent / "hstu_evaluate_ranks.py", out, out, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    assert ranks[0]["users"] % 2 == 1  # one rank's share of the users is filled up
    for rank in ranks:
        assert rank["after_fit"].keys() == rank["after_evaluation"].keys()
        for name, shard in rank["after_fit"].items():
            assert torch.equal(rank["after_evaluation"][name], shard), name
    assert any(  # the shards differ between ranks (row-wise): there was something to overwrite
        not torch.equal(ranks[0]["after_fit"][k], ranks[1]["after_fit"][k])
        for k in ranks[0]["after_fit"]
        if ranks[0]["after_fit"][k].shape == ranks[1]["after_fit"][k].shape
    )
    assert ranks[0]["validated"] == ranks[1]["validated"] and ranks[0]["tested"] == ranks[1]["tested"]
    assert set(ranks[0]["validated"]) >= {"val/all/HR@10", "val/unseen/NDCG@10"}
    assert all(math.isfinite(v) for v in [*ranks[0]["validated"].values(), *ranks[0]["tested"].values()])


@pytest.fixture(scope="module")
def predictions(tmp_path_factory):
    """One fit on two ranks, then its predictions on 8 pairs and on 9 (one launch)."""
    out = tmp_path_factory.mktemp("predict") / "out"
    out.mkdir()
    return run_script(SCRIPT.parent / "hstu_predict_ranks.py", out, out, 8, 9, timeout=300), out


@pytest.mark.parametrize("pairs", [8, 9])
def test_predict_on_two_ranks_runs_on_equal_shares_and_refuses_unequal_ones(pairs, predictions):
    """trainer.predict on two ranks with sharded tables: Lightning's predict sampler splits 8 pairs into 2
    batches of 2 per rank, which predict; 9 pairs into 3 batches and 2, which would hang rank 0 in its third
    batch's lookup (an all-to-all rank 1 never joins): both ranks raise a clear error before any batch."""
    result, out = predictions
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [torch.load(out / f"pairs{pairs}.rank{r}.pt", weights_only=False) for r in (0, 1)]
    if pairs == 8:
        for rank in ranks:
            assert "error" not in rank, rank["error"]
            assert [len(rows) for rows in rank["predictions"]] == [2, 2]
            assert all(len(items) == 5 and 0 not in items for rows in rank["predictions"] for items in rows)
    else:
        for rank in ranks:
            assert rank.get("error", "").startswith(
                "the predict dataloader 0 gives the ranks different numbers of batches (rank 0: 3, rank 1: 2)"
            ), rank


def test_input_all_to_alls_on_a_group_of_their_own_train_to_the_steps_groups_weights(tmp_path):
    """input_dist_group="own" on two ranks: every input all-to-all of the sharded tables runs on the group of
    its own (TorchRec's default, the step's group, for the run without it), and the dense weights and each
    rank's table shards come out bitwise those of the run on the step's group, also under full_split_d6 with
    random delays in the tasks (the input distribution on its own thread, steps ahead of the compute)."""
    out = tmp_path / "out"
    out.mkdir()
    runs = ["legacy_none", "legacy_none+inputgroup", "full_split_d6+inputgroup+delays"]
    result = run_script(SCRIPT.parent / "hstu_presets.py", out, out, 6, *runs, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    saved = {run: [torch.load(out / f"{run}.rank{r}.pt", weights_only=False) for r in (0, 1)] for run in runs}
    for rank in saved["legacy_none"]:
        assert rank["input_groups"] and set(rank["input_groups"]) == {"world"}
    for run in runs[1:]:
        for rank, expected in zip(saved[run], saved["legacy_none"]):
            assert rank["global_step"] == 6
            assert rank["input_groups"] and set(rank["input_groups"]) == {"own"}, run
            for part in ("dense", "sparse"):
                for name, value in expected[part].items():
                    assert torch.equal(rank[part][name], value), f"{run}: {part} {name}"
