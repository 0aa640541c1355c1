"""Two processes on gloo: the result equals Lightning's own DDP, and ranks agree on the end of data, so a
rank with fewer batches ends the epoch for everyone instead of hanging them."""

import os
from pathlib import Path

import pytest
import torch

from ranks import run_script

SCRIPT = Path(__file__).parent / "scripts" / "fit_two_ranks.py"
SIGTERM_SCRIPT = SCRIPT.parent / "sigterm_fit_two_ranks.py"


def fits_on_two_ranks(strategies, out_dir, data="even", options=()) -> dict[str, list[dict]]:
    """Each strategy's fit, one after the other in one launch of two ranks: per strategy, each rank's results."""
    out_dir.mkdir()
    result = run_script(SCRIPT, out_dir, out_dir, *strategies, "--data", data, *options, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return {s: [torch.load(out_dir / f"{s}.rank{r}.pt", weights_only=False) for r in (0, 1)] for s in strategies}


def fit_two_ranks(strategy, out_dir, data="even", options=()) -> list[dict]:
    return fits_on_two_ranks([strategy], out_dir, data, options)[strategy]


@pytest.fixture(scope="module")
def even_fits(tmp_path_factory):
    """Lightning's DDP and two presets on the same data (one launch: its interpreters and imports cost more
    than a fit of the toy model)."""
    return fits_on_two_ranks(["ddp", "hstu_default_d6", "hstu_per_task_d3"], tmp_path_factory.mktemp("even") / "out")


@pytest.mark.parametrize("strategy", ["hstu_default_d6", "hstu_per_task_d3"])
def test_two_ranks_equal_lightnings_ddp(strategy, even_fits):
    ranks = even_fits[strategy]
    for got, expected in zip(ranks, even_fits["ddp"]):
        assert got["seen"] == expected["seen"]  # each rank trained its DistributedSampler share, in order
        assert got["global_step"] == expected["global_step"] == 16
        assert got["groups"] == expected["groups"] == 1  # the strategy's own gloo groups ended with the fit
        for name, value in expected["weights"].items():
            assert torch.equal(got["weights"][name], value), name
    for name, value in ranks[0]["weights"].items():  # and the ranks agree with each other
        assert torch.equal(ranks[1]["weights"][name], value), name


@pytest.mark.parametrize("data", ["uneven", "uneven_sized"])
def test_a_rank_with_fewer_batches_ends_the_epoch_for_all(data, tmp_path):
    """Loaders without a length (rank 0 has 10 batches, rank 1 has 6) and with one (rank 0 has 6, rank 1 has
    10: the short rank reaches its own batch count and must still answer the others' "I have a batch"). The
    fits validate twice an epoch: every rank at the same steps (with lengths of their own, the ranks placed
    validation by their own lengths, at different batches, and hung waiting for each other)."""
    ranks = fit_two_ranks("hstu_full_split_d6", tmp_path / "out", data=data, options=["--validate"])
    for rank in ranks:
        assert rank["global_step"] == 2 * 6  # both stop at the short rank's 6 batches, each epoch
        assert [idx for idx, _ in rank["seen"]] == list(range(6)) * 2
    for name, value in ranks[0]["weights"].items():
        assert torch.equal(ranks[1]["weights"][name], value), name
    assert ranks[0]["validated_at"] == ranks[1]["validated_at"] == [3, 6, 9, 12]
    long, short = (0, 1) if data == "uneven" else (1, 0)
    assert ranks[short]["untrained_warnings"] == []
    assert len(ranks[long]["untrained_warnings"]) == 2  # once per epoch, on the rank whose batches go untrained
    first = ranks[long]["untrained_warnings"][0]
    if data == "uneven":
        assert first.startswith(f"rank {long}: another rank ran out of training data first")
    else:
        assert first.startswith(f"rank {long}: another rank has 6 training batches this epoch, this rank 10")


@pytest.mark.parametrize(
    ("preset", "signalled", "at_batch", "stopped_at"),
    [("legacy_none", 1, 3, {5}), ("default_d6", 1, 3, {5}), ("default_d6", 0, 3, {4, 5}), ("default_d6", 1, 15, {16})],
)
def test_sigterm_to_one_rank_stops_every_rank_at_the_same_batch(preset, signalled, at_batch, stopped_at, tmp_path):
    """A real SIGTERM, sent by a rank to itself at the start of its batch ``at_batch`` of the first epoch of 16
    (rank 0's launcher passes it on to rank 1): both ranks stop at the same step with Lightning's
    SIGTERMException and the same weights, and OnExceptionCheckpoint saves that step. The check before batch
    4 asks the ranks about batch 3's SIGTERM and the one before batch 5 reads the answer (5 batches trained);
    rank 1 gets rank 0's SIGTERM from the launcher up to a batch behind rank 0, so it may ask about it
    already at its check before batch 3 (4 trained). A SIGTERM during an epoch's last batch is known to every
    rank at the epoch's end, and the next epoch trains nothing (16). Before, the handler broadcast on the
    default group: SIGTERM to rank 1 hung rank 0 every time (and rank 1 failed at the next gradient
    all-reduce), SIGTERM to rank 0 hung both in about one run of four."""
    result = run_script(SIGTERM_SCRIPT, tmp_path, tmp_path, preset, signalled, at_batch, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in (0, 1)]
    for rank in ranks:
        assert rank["ended"] == "SIGTERMException"
        assert rank["global_step"] in stopped_at
    assert ranks[0]["global_step"] == ranks[1]["global_step"]
    for name, value in ranks[0]["weights"].items():
        assert torch.equal(ranks[1]["weights"][name], value), name
    saved = torch.load(tmp_path / "on_exception.ckpt", weights_only=False)
    assert saved["global_step"] == ranks[0]["global_step"]
    for name, value in saved["state_dict"].items():
        assert torch.equal(ranks[0]["weights"][name], value), name


def test_the_sigterm_check_stops_every_rank_when_any_rank_received_it(tmp_path):
    """The per-batch check itself, with each combination of the two ranks' flags: any rank's SIGTERM stops
    both at the check after the one that asked (Lightning's check reads rank 0's alone, so a SIGTERM to rank 1
    only stopped rank 1, alone, at the end of the epoch); the check that asks never stops (it does not wait
    for the answer)."""
    out = tmp_path / "out"
    out.mkdir()
    script = Path(__file__).parent / "scripts" / "sigterm_two_ranks.py"
    result = run_script(script, out, out, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):
        saved = torch.load(out / f"rank{rank}.pt", weights_only=False)
        expected = {(False, False): False, (False, True): True, (True, False): True, (True, True): True}
        assert saved["raised"] == expected, rank
        assert not any(saved["raised_when_asked"].values()), rank


def test_an_ordinary_module_with_sharded_tables_trains_as_under_lightnings_ddp(tmp_path):
    """A LightningModule of one's own with a TorchRec-sharded table and no HSTU task hooks, on two ranks:
    torch DDP wraps its dense layer, and the strategy leaves the table shards out of it (torch DDP cannot
    wrap them: before, fit failed in DDP's constructor). The result equals Lightning's DDP given the same
    shards to ignore by the module itself, bit for bit on each rank, and the shards were trained."""
    script = SCRIPT.parent / "sharded_module_ranks.py"
    out = tmp_path / "out"
    out.mkdir()
    for strategy in ("ddp", "default_d6"):
        result = run_script(script, out, out, strategy, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):
        ddp, ours = (torch.load(out / f"{s}.rank{rank}.pt", weights_only=False) for s in ("ddp", "default_d6"))
        for part in ("head", "after"):
            for name, tensor in ddp[part].items():
                assert torch.equal(ours[part][name], tensor), (rank, part, name)
        assert all(not torch.equal(ours["before"][name], shard) for name, shard in ours["after"].items())


def test_a_users_own_collectives_in_the_step_in_logging_and_in_callbacks_run_as_under_lightnings_ddp(tmp_path):
    """On two ranks, ``self.all_gather`` in training_step (the compute thread under the threaded preset),
    ``sync_dist`` logging per step and per epoch, a synced validation metric that EarlyStopping reads, and a
    callback's all-gather and barrier at each epoch end: no hang, and each rank's weights, batches, losses,
    gathered values and callback metrics are Lightning's DDP's."""
    script = SCRIPT.parent / "collectives_two_ranks.py"
    out = tmp_path / "out"
    out.mkdir()
    result = run_script(script, out, out, "ddp", "legacy_none", "default_d6", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):
        ddp = torch.load(out / f"ddp.rank{rank}.pt", weights_only=False)
        assert ddp["global_step"] < 4 * 8  # early stopping ended the fit before its four epochs
        assert ddp["gathered"][0] == [8, 108]  # both ranks' values, gathered at the first epoch end
        for preset in ("legacy_none", "default_d6"):
            ours = torch.load(out / f"{preset}.rank{rank}.pt", weights_only=False)
            for key in ("seen", "global_step", "gathered", "losses", "metrics"):
                assert ours[key] == ddp[key], (preset, rank, key)
            for name, value in ddp["weights"].items():
                assert torch.equal(ours["weights"][name], value), (preset, rank, name)


@pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or not {0, 1} <= os.sched_getaffinity(0), reason="needs Linux, cores 0 and 1"
)
def test_pin_threads_gives_each_rank_of_a_machine_its_own_core(tmp_path, even_fits):
    """HSTUPipelineStrategy(pin_threads=[0, 1]): local rank i's training steps on core i (from the end of each
    epoch's first batch), and the same weights as without pinning."""
    ranks = fit_two_ranks("hstu_default_d6", tmp_path / "out", options=["--pin-threads", "0,1"])
    unpinned = even_fits["hstu_default_d6"]
    for rank, (got, expected) in enumerate(zip(ranks, unpinned)):
        cores = got["step_cores"]
        assert len(cores) == 16
        assert [c for i, c in enumerate(cores) if i not in (0, 8)] == [[rank]] * 14  # 8 batches an epoch
        assert all(len(cores[i]) > 1 for i in (0, 8))
        for name, value in expected["weights"].items():
            assert torch.equal(got["weights"][name], value), name
