"""Sharded checkpoints under faults: no code from a checkpoint runs unless the caller trusts it
(``weights_only=False``), a save that fails at any stage leaves the previous checkpoints whole and
loadable (and resuming from them equals the run that never failed), and a directory that mixes two saves
is refused. The HSTU recommender on one process (its tables are sharded, so its checkpoints are
directories); tests/test_hstu_checkpoint.py has the two-rank ones."""

import io
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed.checkpoint as dcp
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, OnExceptionCheckpoint

from lightning_runs import QUIET
from ranks import launch_env
from ranks import run_script as run_ranks_script
from small_hstu import SMALL_MODEL, small_data

from lightning_hstu import HSTUPipelineStrategy
from lightning_hstu.loops import CheckpointError
from lightning_hstu.models.hstu import HSTURecommender
from lightning_hstu.strategies import sharded_checkpoint

SCRIPTS = Path(__file__).parent / "scripts"
SCRIPT = SCRIPTS / "hstu_resume.py"


def fit_hstu(
    max_steps: int, dirpath: Path | None = None, ckpt_path: Path | None = None, weights_only=None, keep: int = 1
):
    """The small HSTU model trained to ``max_steps``; with ``dirpath``, a checkpoint every three steps (the
    newest ``keep`` kept, and ``last.ckpt``). Returns the trained model."""
    pl.seed_everything(0, verbose=False)
    model = HSTURecommender(**SMALL_MODEL)
    callbacks = (
        []
        if dirpath is None
        else [
            ModelCheckpoint(dirpath=dirpath, every_n_train_steps=3, save_top_k=keep, save_last=True, filename="{step}")
        ]
    )
    trainer = pl.Trainer(
        strategy=HSTUPipelineStrategy("default_d6"),
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=dirpath is not None,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=callbacks,
    )
    trainer.fit(model, small_data(), ckpt_path=None if ckpt_path is None else str(ckpt_path), weights_only=weights_only)
    return model


def trained_state(model) -> dict[str, torch.Tensor]:
    """Every weight and the fused sparse optimizer's state, as plain tensors (the local shards)."""
    state = {
        **model.state_dict(),
        **{f"sparse.{k}": v for k, v in _flat(model.embeddings.model_parallel.fused_optimizer.state_dict()["state"])},
    }
    return {
        name: (value.local_shards()[0].tensor if hasattr(value, "local_shards") else value).clone()
        for name, value in state.items()
        if hasattr(value, "local_shards") or isinstance(value, torch.Tensor)
    }


def _flat(state: dict, prefix: str = ""):
    for key, value in state.items():
        if isinstance(value, dict):
            yield from _flat(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def assert_same_state(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


def saved_step(checkpoint: Path) -> int:
    return torch.load(checkpoint / "lightning.pt", weights_only=True)["global_step"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The run that never failed: its checkpoints (step 3 and 6, and last) and its trained state."""
    out = tmp_path_factory.mktemp("uninterrupted")
    return out, trained_state(fit_hstu(6, dirpath=out, keep=-1))


# ----- no code from a checkpoint unless asked ---------------------------------------------------------------


def leave_marker(path: str) -> None:
    """What hostile code in a checkpoint would run (here: it only writes a file)."""
    Path(path).write_text("code from a checkpoint ran")


class Payload:
    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return leave_marker, (self.marker,)


def plant_in_lightning_file(checkpoint: Path, marker: Path) -> None:
    state = torch.load(checkpoint / "lightning.pt", weights_only=False)
    state["hyper_parameters"]["note"] = Payload(marker)
    torch.save(state, checkpoint / "lightning.pt")


def plant_in_shard_metadata(checkpoint: Path, marker: Path) -> None:
    with open(checkpoint / ".metadata", "rb") as file:
        metadata = pickle.load(file)
    metadata.storage_meta.modules = [Payload(marker)]
    with open(checkpoint / ".metadata", "wb") as file:
        pickle.dump(metadata, file)


@pytest.mark.parametrize("plant", [plant_in_lightning_file, plant_in_shard_metadata])
@pytest.mark.parametrize("weights_only", [True, None])  # None: the default
def test_code_planted_in_a_checkpoint_does_not_run(uninterrupted, tmp_path, plant, weights_only):
    out, _ = uninterrupted
    checkpoint, marker = tmp_path / "copied.ckpt", tmp_path / "marker"
    shutil.copytree(out / "step=6.ckpt", checkpoint)
    plant(checkpoint, marker)
    with pytest.raises(CheckpointError) as info:
        fit_hstu(6, ckpt_path=checkpoint, weights_only=weights_only)
    assert not marker.exists()
    message = str(info.value)
    assert "leave_marker" in message and "weights_only=False" in message  # what was refused, and the way out


def test_weights_only_false_is_the_callers_trust(uninterrupted, tmp_path):
    out, expected = uninterrupted
    checkpoint, marker = tmp_path / "copied.ckpt", tmp_path / "marker"
    shutil.copytree(out / "step=3.ckpt", checkpoint)
    plant_in_lightning_file(checkpoint, marker)
    resumed = fit_hstu(6, ckpt_path=checkpoint, weights_only=False)
    assert marker.exists()  # asked for: the checkpoint's code ran
    assert_same_state(trained_state(resumed), expected)


def test_a_non_tensor_shard_entry_is_read_weights_only(tmp_path):
    marker = tmp_path / "marker"
    dcp.save({"plain": torch.ones(2), "note": Payload(marker)}, checkpoint_id=tmp_path / "shards", no_dist=True)
    state = {"plain": torch.zeros(2), "note": None}
    with pytest.raises(CheckpointError, match="leave_marker"):
        sharded_checkpoint.load_shards(state, tmp_path / "shards", safe=True)
    assert not marker.exists()
    sharded_checkpoint.load_shards(state, tmp_path / "shards", safe=False)  # trusted: DCP's own reader
    assert marker.exists() and torch.equal(state["plain"], torch.ones(2))


# ----- atomic saves ----------------------------------------------------------------------------------------


class Injected(OSError):
    pass


def fail_on(target: str, nth: int, monkeypatch, stage: str) -> None:
    """Make the ``nth`` save of the checkpoint named ``target`` fail at ``stage``: while DCP writes the
    shards (before its metadata), while ``lightning.pt`` is written (half of it on disk), or once everything
    is written, before the directory is renamed into place."""
    seen = {"calls": 0}

    def hit(path) -> bool:
        if target not in str(path):
            return False
        seen["calls"] += 1
        return seen["calls"] == nth

    if stage == "shards":
        writer = dcp.FileSystemWriter
        finish = writer.finish

        def failing_finish(self, *args, **kwargs):
            if hit(self.path):
                raise Injected("no space left on device (injected, DCP save)")
            return finish(self, *args, **kwargs)

        monkeypatch.setattr(writer, "finish", failing_finish)
    elif stage == "lightning.pt":
        save = torch.save

        def failing_save(obj, f, *args, **kwargs):
            if str(f).endswith("lightning.pt") and hit(f):
                save(obj, f, *args, **kwargs)
                Path(f).write_bytes(Path(f).read_bytes()[: os.path.getsize(f) // 2])
                raise Injected("no space left on device (injected, lightning.pt)")
            return save(obj, f, *args, **kwargs)

        monkeypatch.setattr(torch, "save", failing_save)
    else:
        move = sharded_checkpoint._move_into_place

        def failing_move(staging, final):
            if hit(staging):
                raise Injected("interrupted before the rename (injected)")
            return move(staging, final)

        monkeypatch.setattr(sharded_checkpoint, "_move_into_place", failing_move)


@pytest.mark.parametrize("stage", ["shards", "lightning.pt", "rename"])
@pytest.mark.parametrize(
    "target, nth, left",
    [
        ("step=6.ckpt", 1, {"step=3.ckpt": 3, "last.ckpt": 3}),  # save_top_k: step=3 is only removed after step=6 saved
        ("last.ckpt", 2, {"step=6.ckpt": 6, "last.ckpt": 3}),  # save_last: the old last.ckpt stays, whole
    ],
)
def test_a_failed_save_leaves_the_previous_checkpoints_whole(
    uninterrupted, tmp_path, monkeypatch, stage, target, nth, left
):
    _, expected = uninterrupted
    with monkeypatch.context() as patch:
        fail_on(target, nth, patch, stage)
        with pytest.raises(CheckpointError, match="injected"):
            fit_hstu(6, dirpath=tmp_path)
    assert sorted(os.listdir(tmp_path)) == sorted(left)  # no partial directory, under any name
    assert {name: saved_step(tmp_path / name) for name in left} == left
    for name in left:  # each one resumes to the run that never failed
        assert_same_state(trained_state(fit_hstu(6, ckpt_path=tmp_path / name)), expected)


def test_a_checkpoint_that_mixes_two_saves_is_refused(uninterrupted, tmp_path):
    out, _ = uninterrupted
    mixed = tmp_path / "mixed.ckpt"
    shutil.copytree(out / "step=6.ckpt", mixed)  # the shards of step 6
    shutil.copy(out / "step=3.ckpt" / "lightning.pt", mixed / "lightning.pt")  # the trainer state of step 3
    with pytest.raises(CheckpointError, match="mixes two saves"):
        fit_hstu(6, ckpt_path=mixed)


def run_script(out_dir: Path, *args: str, devices: int) -> subprocess.CompletedProcess:
    out_dir.mkdir(exist_ok=True)
    return subprocess.run(
        [sys.executable, str(SCRIPT), str(out_dir), "6", "--devices", str(devices), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=out_dir,
        env=launch_env(),
    )


def test_a_save_failing_on_rank_0_is_an_error_on_every_rank_not_a_hang(tmp_path):
    result = run_script(tmp_path / "run", "--save-every", "3", "--fail-lightning-file", "step=6.ckpt", devices=2)
    assert result.returncode != 0
    assert result.stderr.count("could not save checkpoint") >= 2, result.stderr[-3000:]  # both ranks report it
    assert sorted(os.listdir(tmp_path / "run")) == ["step=3.ckpt"]


def test_a_save_killed_midway_leaves_the_previous_checkpoint_and_is_cleaned_up_by_the_next(tmp_path):
    killed = run_script(tmp_path / "run", "--save-every", "3", "--kill-in-lightning-file", "step=6.ckpt", devices=1)
    assert killed.returncode != 0
    entries = sorted(os.listdir(tmp_path / "run"))
    assert "step=6.ckpt" not in entries and "step=3.ckpt" in entries
    resumed = run_script(
        tmp_path / "run", "--save-every", "3", "--resume", str(tmp_path / "run" / "step=3.ckpt"), devices=1
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert sorted(p for p in os.listdir(tmp_path / "run") if p.endswith("ckpt") or p.startswith(".")) == [
        "step=3.ckpt",
        "step=6.ckpt",
    ]  # the killed save's leftovers are gone


class FailsAfterBackward(Callback):
    """Raises in on_after_backward of batch 3: the tables' fused optimizer has applied the batch, the dense
    optimizer step has not run."""

    def on_after_backward(self, trainer, pl_module):
        if trainer.fit_loop.epoch_loop.batch_idx == 3:
            raise RuntimeError("failed after backward")


@pytest.mark.parametrize("engine", [True, False])
def test_a_checkpoint_with_the_tables_a_batch_ahead_is_refused_for_training_on(engine, tmp_path):
    """A checkpoint saved after a step failed between backward (which applies the batch to the tables) and the
    dense optimizer step (Lightning's OnExceptionCheckpoint) holds the tables one batch ahead of the dense
    weights; resumed, the batch would be applied to the tables twice. Training on from it is refused, naming
    the batch, before anything is loaded; evaluation may load it."""

    def trainer(**kwargs):
        return pl.Trainer(
            strategy=HSTUPipelineStrategy("default_d6", engine=engine),
            accelerator="cpu",
            devices=1,
            max_steps=8,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            limit_val_batches=2,
            default_root_dir=tmp_path,
            **kwargs,
        )

    pl.seed_everything(0, verbose=False)
    failing = trainer(enable_checkpointing=True, callbacks=[FailsAfterBackward(), OnExceptionCheckpoint(tmp_path)])
    with pytest.raises(Exception, match="failed after backward"):
        failing.fit(HSTURecommender(**SMALL_MODEL), small_data())
    saved = tmp_path / "on_exception.ckpt"
    model = HSTURecommender(**SMALL_MODEL)
    with pytest.raises(CheckpointError, match=r"after the step of batch 3 \(epoch 0\) failed between backward"):
        trainer(enable_checkpointing=False).fit(model, small_data(), ckpt_path=str(saved))
    trainer(enable_checkpointing=False).validate(HSTURecommender(**SMALL_MODEL), small_data(), ckpt_path=str(saved))


# ----- a checkpoint of another model is refused -------------------------------------------------------------


@pytest.mark.parametrize(
    "settings, named",
    [
        # the same weight shapes (2 heads of 8 wide against 1 of 16): the weights would load and mean other things
        (dict(num_heads=1, attention_dim=16, hidden_dim=16), "num_heads=2 in the checkpoint, 1 here"),
        # no ranking head: the checkpoint's head would be dropped without a word
        (dict(ranking_weight=0.0), "holds weights the running module does not have: objectives.ranking"),
    ],
    ids=["same shapes, other heads", "fewer weights"],
)
def test_a_checkpoint_of_a_model_of_another_configuration_is_refused(uninterrupted, settings, named):
    """DCP fills the running module's entries and ignores the checkpoint's others, and equal shapes load
    whatever they mean: test metrics came out of a model that was never trained (NDCG@10 0.23 against 0.27)."""
    out, _ = uninterrupted
    model = HSTURecommender(**{**SMALL_MODEL, **settings})
    trainer = pl.Trainer(strategy=HSTUPipelineStrategy("default_d6"), accelerator="cpu", devices=1, **QUIET)
    with pytest.raises(CheckpointError, match=named):
        trainer.test(model, small_data(), ckpt_path=str(out / "step=6.ckpt"), verbose=False)


def test_a_checkpoint_directory_without_its_trainer_state_is_refused_naming_it(tmp_path):
    """Shards and DCP's index but no lightning.pt (a save that did not finish, a file removed): Lightning's
    load failed with IsADirectoryError."""
    from lightning_hstu import HSTUPipelineStrategy
    from lightning_hstu.loops import CheckpointError

    broken = tmp_path / "broken.ckpt"
    broken.mkdir()
    (broken / ".metadata").write_bytes(b"")
    (broken / "__0_0.distcp").write_bytes(b"")
    with pytest.raises(CheckpointError, match="holds shards but no lightning.pt"):
        HSTUPipelineStrategy("default_d6").load_checkpoint(broken)


def dies_halfway_into(target: str, nth: int, monkeypatch) -> None:
    """The ``nth`` write of a file whose name holds ``target`` stops halfway with an error (a full disk, a job
    killed): whether the bytes go through ``torch.save`` into the file or are copied into it from elsewhere."""
    seen = {"calls": 0}

    def hit(name) -> bool:
        if target not in Path(str(name)).name:
            return False
        seen["calls"] += 1
        return seen["calls"] == nth

    save, copyfile = torch.save, shutil.copyfile

    def failing_save(obj, f, *args, **kwargs):
        if not hit(getattr(f, "name", f)):
            return save(obj, f, *args, **kwargs)
        buffer = io.BytesIO()
        save(obj, buffer, *args, **kwargs)
        data = buffer.getvalue()[: len(buffer.getvalue()) // 2]
        f.write(data) if hasattr(f, "write") else Path(f).write_bytes(data)
        raise Injected("killed halfway through the checkpoint (injected)")

    def failing_copyfile(src, dst, *args, **kwargs):
        if not hit(dst):
            return copyfile(src, dst, *args, **kwargs)
        Path(dst).write_bytes(Path(src).read_bytes()[: os.path.getsize(src) // 2])
        raise Injected("killed halfway through the checkpoint (injected)")

    monkeypatch.setattr(torch, "save", failing_save)
    monkeypatch.setattr(shutil, "copyfile", failing_copyfile)


def test_a_checkpoint_file_killed_halfway_leaves_the_previous_one_whole(tmp_path, monkeypatch):
    """A module without sharded tables saves one file (the toy model, SASRec). Lightning wrote it in the
    system's temporary folder and moved it over the checkpoint; with that folder on another file system than
    the checkpoints (a node's /tmp, checkpoints on a shared disk) the move copies into the checkpoint itself,
    and a save of last.ckpt killed during the copy left last.ckpt cut short: the previous one lost, and no
    checkpoint to resume from."""
    from lightning_runs import assert_same_weights, fit

    elsewhere = Path("/dev/shm")
    if not elsewhere.is_dir() or os.stat(elsewhere).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs a temporary folder on another file system than tmp_path (/dev/shm)")
    monkeypatch.setattr(tempfile, "tempdir", tempfile.mkdtemp(dir=elsewhere))
    uninterrupted, _ = fit(HSTUPipelineStrategy("default_d6"), max_steps=6)
    saved = tmp_path / "checkpoints"
    saver = ModelCheckpoint(dirpath=saved, every_n_train_steps=3, save_top_k=0, save_last=True)
    with monkeypatch.context() as patch:
        dies_halfway_into("last.ckpt", 2, patch)  # the save at step 6
        with pytest.raises(CheckpointError, match="could not save checkpoint .*last.ckpt.*Injected") as raised:
            fit(HSTUPipelineStrategy("default_d6"), max_steps=6, enable_checkpointing=True, callbacks=[saver])
    assert isinstance(raised.value.__cause__, Injected)
    assert os.listdir(saved) == ["last.ckpt"]  # nothing half-written left beside it
    assert torch.load(saved / "last.ckpt", weights_only=True)["global_step"] == 3
    resumed, _ = fit(HSTUPipelineStrategy("default_d6"), max_steps=6, ckpt_path=saved / "last.ckpt")
    assert_same_weights(resumed, uninterrupted)


def test_a_checkpoint_file_failing_on_rank_0_is_an_error_on_every_rank_not_a_hang(tmp_path):
    """A checkpoint without sharded tables is written by rank 0 alone: its failure (a full disk) is an error
    on both ranks, not rank 1 waiting at Lightning's barrier after the save until the process group's timeout;
    the earlier checkpoints stay whole and nothing half-written is left."""
    out = tmp_path / "run"
    out.mkdir()
    result = run_ranks_script(SCRIPTS / "save_fails_two_ranks.py", out, out, timeout=300)
    assert result.returncode != 0
    for rank in (0, 1):
        assert f"rank {rank}: could not save checkpoint" in result.stderr, result.stderr[-3000:]
    assert sorted(os.listdir(out)) == ["step=2.ckpt"]
    assert torch.load(out / "step=2.ckpt", weights_only=False)["global_step"] == 2


def test_the_leftovers_of_a_killed_save_go_with_the_next_save_whatever_the_name(tmp_path):
    """A killed save leaves a hidden ``.<name>.<id>.saving`` beside the checkpoint; the next save of that name
    removes it, also where the name holds glob characters (``ModelCheckpoint(filename="{epoch}-[best]")``)."""
    target = tmp_path / "epoch=0-[best].ckpt"
    leftover = tmp_path / f".{target.name}.0123abcd.saving"
    leftover.write_bytes(b"half a checkpoint")
    sharded_checkpoint.save_file({"global_step": 1}, target, True, lambda reported: reported)
    assert sorted(os.listdir(tmp_path)) == [target.name]
    assert torch.load(target, weights_only=True) == {"global_step": 1}


# ----- a damaged checkpoint is named ------------------------------------------------------------------------


def cut_short(file: Path) -> None:
    file.write_bytes(file.read_bytes()[: os.path.getsize(file) // 2])


def overwrite_middle(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 16] = b"\x9f" * 16
    file.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "entry, damage",
    [
        (None, cut_short),  # a plain .ckpt file (a module without sharded tables)
        (None, lambda file: file.write_bytes(b"")),
        (None, lambda file: file.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:0\n")),
        ("lightning.pt", cut_short),
        (".metadata", cut_short),
        (".metadata", overwrite_middle),
    ],
    ids=[
        "ckpt cut short",
        "ckpt empty",
        "ckpt a git-lfs pointer",
        "lightning.pt cut short",
        ".metadata cut short",
        ".metadata overwritten",
    ],
)
def test_a_damaged_checkpoint_file_is_refused_naming_it(uninterrupted, tmp_path, entry, damage):
    """A checkpoint cut short by a copy or a disk that filled up: the fit failed with torch's and pickle's
    errors, which name no file and do not say it is the checkpoint (``OSError: [Errno 22] Invalid argument``
    for a .ckpt cut short, a bare ``EOFError`` for an empty one, ``UnpicklingError: pickle data was
    truncated`` or ``UnicodeDecodeError`` for DCP's index). A .ckpt that is no checkpoint at all (a git-lfs
    pointer) raised torch's weights_only refusal, which says that ``weights_only=False`` "will likely
    succeed" (it runs the file as code, and fails with ``invalid load key``)."""
    if entry is None:
        from lightning_runs import fit

        saver = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, filename="{step}")
        fit(HSTUPipelineStrategy("default_d6"), max_steps=3, enable_checkpointing=True, callbacks=[saver])
        checkpoint = damaged = tmp_path / "step=3.ckpt"
        damage(damaged)
        for weights_only in (None, False):
            with pytest.raises(CheckpointError, match=rf"checkpoint file {checkpoint} could not be read .*damaged"):
                fit(HSTUPipelineStrategy("default_d6"), ckpt_path=checkpoint, weights_only=weights_only)
        return
    out, _ = uninterrupted
    checkpoint = tmp_path / "copied.ckpt"
    shutil.copytree(out / "step=3.ckpt", checkpoint)
    damage(checkpoint / entry)
    with pytest.raises(CheckpointError, match=rf"checkpoint file {checkpoint / entry} could not be read .*damaged"):
        fit_hstu(6, ckpt_path=checkpoint)


# ----- where a checkpoint file is written -----------------------------------------------------------------


@pytest.mark.parametrize("spelled", ["~/saved/step.ckpt", "file://{home}/saved/step.ckpt"], ids=["~", "file://"])
def test_a_checkpoint_file_is_written_where_lightning_reads_it(tmp_path, monkeypatch, spelled):
    """A path as Lightning's checkpoint I/O takes it (fsspec: ``~`` is the home directory, ``file://`` a local
    URL): the file is written there, and the same path resumes from it. The strategy's own atomic write took
    the path literally: ``~/saved/step.ckpt`` went to a folder named ``~`` in the working directory, and a fit
    with ``ckpt_path="~/saved/step.ckpt"`` read the home directory's (missing, or an older one)."""
    from lightning_runs import fit

    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir(), work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    path = spelled.format(home=home)
    _, trainer = fit(HSTUPipelineStrategy("default_d6"), max_steps=3, default_root_dir=tmp_path)
    trainer.save_checkpoint(path)
    assert os.listdir(work) == []
    assert torch.load(home / "saved" / "step.ckpt", weights_only=True)["global_step"] == 3
    resumed, _ = fit(HSTUPipelineStrategy("default_d6"), max_steps=4, ckpt_path=path, default_root_dir=tmp_path)
    assert resumed.trainer.global_step == 4
