"""The evaluation a user reads: the best validation epoch's weights tested once, the report beside other
models' runs and the most-popular baseline, and the SASRec baseline on the same data and metrics."""

import json
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger

from lightning_runs import SharedDirectoryLogger
from ranks import run_script
from small_hstu import small_data

from lightning_hstu.callbacks import FitSummary, RankingReport
from lightning_hstu.data.evaluation import METRICS, RANKINGS
from lightning_hstu.data.histories import HistoryDataModule
from lightning_hstu.models.sasrec import SASRecRecommender

SMALL_SASREC = dict(embedding_dim=16, num_layers=1, num_heads=2, max_seq_len=32, dropout=0.0, lr=0.01)


class PeaksAtEpoch1(SASRecRecommender):
    """Logs a validation score that is best at epoch 1 (of 3)."""

    def validation_step(self, batch, batch_idx):
        super().validation_step(batch, batch_idx)
        self.log("val/score", float(self.current_epoch == 1), batch_size=batch.size)


class NanAtEpoch0(SASRecRecommender):
    """Logs a validation score that is NaN at epoch 0 (a diverged start), then best at epoch 2 (of 3)."""

    def validation_step(self, batch, batch_idx):
        super().validation_step(batch, batch_idx)
        score = float("nan") if self.current_epoch == 0 else float(self.current_epoch)
        self.log("val/score", score, batch_size=batch.size)


class WeightsAtValidation(Callback):
    def __init__(self):
        self.by_epoch = {}

    def on_validation_end(self, trainer, pl_module):
        self.by_epoch[trainer.current_epoch] = [w.detach().clone() for w in pl_module.evaluation_weights()]


def fit_and_test(tmp_path, model, report, epochs=3, extra=(), data=None):
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=epochs,
        logger=CSVLogger(tmp_path),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[report, *extra],
    )
    data = small_data(negatives=0) if data is None else data
    trainer.fit(model, data)
    trainer.test(model, datamodule=data, verbose=False)
    return trainer


def test_the_test_runs_with_the_best_validation_epochs_weights(tmp_path):
    seen = WeightsAtValidation()
    report = RankingReport(monitor="val/score")
    model = PeaksAtEpoch1(**SMALL_SASREC)
    fit_and_test(tmp_path, model, report, extra=[seen])
    assert report.best_epoch == 1
    for live, best, last in zip(model.evaluation_weights(), seen.by_epoch[1], seen.by_epoch[2]):
        assert torch.equal(live, best)
    assert not all(torch.equal(b, c) for b, c in zip(seen.by_epoch[1], seen.by_epoch[2]))  # training moved on


def test_a_nan_validation_score_never_stays_the_best(tmp_path):
    report = RankingReport(monitor="val/score")
    fit_and_test(tmp_path, NanAtEpoch0(**SMALL_SASREC), report)
    assert (report.best_epoch, report.best_score) == (2, 2.0)


def test_the_report_sets_runs_of_the_same_data_side_by_side(tmp_path, capsys):
    first = fit_and_test(tmp_path, SASRecRecommender(**SMALL_SASREC), RankingReport(name="SASRec-a"), epochs=1)
    saved = json.loads((Path(first.log_dir) / "ranking.json").read_text())
    assert saved["model"] == "SASRec-a" and set(saved["metrics"]) == set(RANKINGS)
    assert set(saved["metrics"]["all"]) == set(METRICS)
    capsys.readouterr()
    second = fit_and_test(tmp_path, SASRecRecommender(**SMALL_SASREC), RankingReport(), epochs=1, extra=[FitSummary()])
    out = capsys.readouterr().out
    full_batches = len(second.datamodule.train_histories) // 8 * 8
    assert f"trained {full_batches} samples in 1 epochs" in out  # every full batch of 8
    report = out[out.index("test (") :]
    for label in RANKINGS.values():
        block = report[report.index(label) :]
        rows = [line.split()[0] for line in block.splitlines()[2:5]]
        assert rows == ["SASRec", "SASRec-a", "most"], block  # this run, the earlier one, the baseline
    assert report.count("version_0") == 2  # the earlier run's directory, named in each block


class FixedHistories(HistoryDataModule):
    """The same histories whatever ``max_seq_len`` reads of them, as a dataset's files (MovieLens)."""

    def load(self):
        return small_data().load()


def test_runs_that_read_histories_of_other_lengths_are_side_by_side_with_their_length(tmp_path, capsys):
    """The main job's HSTU reads 400 events, the SASRec example 200: the report matched runs by a description
    that named the histories' length, so it left out the SASRec run of the same users and held-out items."""
    model = dict(SMALL_SASREC, max_seq_len=16)
    first = fit_and_test(
        tmp_path,
        SASRecRecommender(**model),
        RankingReport(name="SASRec-16"),
        1,
        data=FixedHistories(batch_size=8, max_seq_len=16, negatives=0),
    )
    capsys.readouterr()
    fit_and_test(
        tmp_path,
        SASRecRecommender(**SMALL_SASREC),
        RankingReport(),
        1,
        data=FixedHistories(batch_size=8, max_seq_len=32, negatives=0),
    )
    report = capsys.readouterr().out
    report = report[report.index("test (") :]
    assert report.startswith("test (FixedHistories (96 users,") and "histories of at most 32 events;" in report
    rows = [line for line in report.splitlines() if line.startswith("  SASRec-16 ")]
    assert len(rows) == 2  # under both rankings
    assert all(f"({first.log_dir}, " in row and "; histories of at most 16 events)" in row for row in rows)

    capsys.readouterr()
    fit_and_test(
        tmp_path,
        SASRecRecommender(**SMALL_SASREC),
        RankingReport(name="other-draw"),
        1,
        data=small_data(negatives=0, max_seq_len=24),
    )
    assert "SASRec-16" not in capsys.readouterr().out  # synthetic data of another length bound: another split


class Losses(Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


def test_sasrec_trains_on_the_history_batches_and_is_tested_under_both_rankings(tmp_path):
    losses = Losses()
    trainer = fit_and_test(tmp_path, SASRecRecommender(**SMALL_SASREC), RankingReport(), epochs=4, extra=[losses])
    per_epoch = len(losses.losses) // 4
    assert sum(losses.losses[-per_epoch:]) < sum(losses.losses[:per_epoch])
    for ranking in RANKINGS:
        for metric in METRICS:
            assert 0.0 <= float(trainer.callback_metrics[f"test/{ranking}/{metric}"]) <= 1.0
    assert trainer.callback_metrics["test/unseen/MRR"] >= trainer.callback_metrics["test/all/MRR"]


def test_the_report_after_fit_and_test_on_two_ranks(tmp_path):
    """`lightning-hstu fit` on several processes: the report runs on rank 0 only, and the log directory it
    writes to is a broadcast every rank joins (before, rank 0 waited in it alone: gloo failed when rank 1
    exited, NCCL would have waited for its timeout)."""
    result = run_script(Path(__file__).parent / "scripts" / "report_two_ranks.py", tmp_path, tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("ranked among all items:") == 1  # printed once, by rank 0
    written = json.loads((tmp_path / "runs" / "version_0" / "ranking.json").read_text())
    assert set(written["metrics"]) == set(RANKINGS) and set(written["metrics"]["all"]) == set(METRICS)


class StopsAfterEpoch(Callback):
    def __init__(self, epoch: int):
        self.epoch = epoch

    def on_validation_end(self, trainer, pl_module):
        if trainer.current_epoch == self.epoch:
            raise RuntimeError(f"stopped after epoch {self.epoch}")


def _trainer(tmp_path, report, epochs, logger=True, extra=()):
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=epochs,
        logger=CSVLogger(tmp_path) if logger else False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[report, *extra],
    )


def _tested_line(out: str) -> str:
    return next(line for line in out.splitlines() if line.startswith("test ("))


def test_the_report_names_the_weights_it_tested(tmp_path, capsys):
    """After a fit that raised, the best epoch's weights were not put back; resumed from a checkpoint whose best
    epoch stays best, they are not in memory; tested from a checkpoint, the checkpoint's: the report said
    "weights of epoch N" in each case (after the resume it called the resumed run's last epoch the best)."""
    data = small_data(negatives=0)
    pl.seed_everything(0, verbose=False)
    model, report = PeaksAtEpoch1(**SMALL_SASREC), RankingReport(monitor="val/score")
    saver = pl.callbacks.ModelCheckpoint(tmp_path / "ckpt", save_last=True)
    trainer = _trainer(tmp_path, report, 3, extra=[saver, StopsAfterEpoch(2)])
    try:
        trainer.fit(model, data)
    except RuntimeError:
        pass
    capsys.readouterr()
    trainer.test(model, datamodule=data, verbose=False)
    assert "weights at the end of fit, not those of the best epoch 1 (val/score 1.0000)" in _tested_line(
        capsys.readouterr().out
    )

    resumed = RankingReport(monitor="val/score")  # a new process: the best epoch comes from the checkpoint
    trainer = _trainer(tmp_path, resumed, 4)
    trainer.fit(PeaksAtEpoch1(**SMALL_SASREC), data, ckpt_path=tmp_path / "ckpt" / "last.ckpt")
    assert (resumed.best_epoch, resumed.best_score) == (1, 1.0)  # epochs 2 and 3 scored 0
    capsys.readouterr()
    trainer.test(trainer.lightning_module, datamodule=data, verbose=False)
    assert "not those of the best epoch 1" in _tested_line(capsys.readouterr().out)

    trainer.test(trainer.lightning_module, datamodule=data, verbose=False, ckpt_path=tmp_path / "ckpt" / "last.ckpt")
    assert f"weights of checkpoint {tmp_path / 'ckpt' / 'last.ckpt'}" in _tested_line(capsys.readouterr().out)


def test_without_a_logger_the_report_writes_no_file_into_the_working_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ranking.json").write_text("the user's own file")
    trainer = _trainer(tmp_path, RankingReport(), 1, logger=False)
    data = small_data(negatives=0)
    trainer.fit(SASRecRecommender(**SMALL_SASREC), data)
    trainer.test(trainer.lightning_module, datamodule=data, verbose=False)
    assert "ranked among all items:" in capsys.readouterr().out  # the report is printed
    assert (tmp_path / "ranking.json").read_text() == "the user's own file"


def test_a_test_without_fit_or_checkpoint_names_the_weights_and_stays_out_of_other_reports(tmp_path, capsys):
    """``lightning-hstu test`` without ``--ckpt_path`` tests the model as built: the report said "weights at the
    end of fit" and wrote ranking.json, so the next run's report showed those untrained numbers as this
    model's latest run (HR@10 0.0064 in place of the trained run's 0.1400)."""
    data = small_data(negatives=0)
    trainer = _trainer(tmp_path, RankingReport(), 1)
    trainer.fit(SASRecRecommender(**SMALL_SASREC), data)
    trainer.test(trainer.lightning_module, datamodule=data, verbose=False)
    fitted = Path(trainer.log_dir)
    assert (fitted / "ranking.json").exists()
    capsys.readouterr()

    untrained = _trainer(tmp_path, RankingReport(), 1)
    untrained.test(SASRecRecommender(**SMALL_SASREC), datamodule=data, verbose=False)
    out = capsys.readouterr().out
    assert "the module's weights as given: no fit ran with this report and no checkpoint was loaded" in out
    assert not (Path(untrained.log_dir) / "ranking.json").exists()
    later = _trainer(tmp_path, RankingReport(name="later"), 1)
    later.fit(SASRecRecommender(**SMALL_SASREC), data)
    later.test(later.lightning_module, datamodule=data, verbose=False)
    assert f"({fitted}," in capsys.readouterr().out  # the SASRec run beside it is the fitted one


def test_a_logger_without_a_run_directory_of_its_own_keeps_other_runs_results(tmp_path, capsys):
    """Under a WandbLogger (save_dir ".") ``trainer.log_dir`` is a directory every run shares: the report wrote
    its ranking.json there, over the last run's (SASRec's result, gone from every later report), and read
    "other runs" from the folders beside it. With no run directory of its own it writes and reads none."""
    shared = tmp_path / "shared"
    (tmp_path / "other_project").mkdir(parents=True)
    shared.mkdir()
    data = small_data(negatives=0)
    data.setup()
    metrics = {ranking: dict.fromkeys(METRICS, 0.5) for ranking in RANKINGS}
    earlier = {"model": "SASRec-a", "data": data.description, "metrics": metrics, "run": "a", "finished": "then"}
    (shared / "ranking.json").write_text(json.dumps(earlier))
    (tmp_path / "other_project" / "ranking.json").write_text(json.dumps({**earlier, "model": "elsewhere"}))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=SharedDirectoryLogger(shared),
        default_root_dir=tmp_path,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[RankingReport()],
    )
    trainer.fit(SASRecRecommender(**SMALL_SASREC), data)
    trainer.test(trainer.lightning_module, datamodule=data, verbose=False)
    out = capsys.readouterr().out
    assert "ranked among all items:" in out  # the report is printed
    assert json.loads((shared / "ranking.json").read_text()) == earlier
    assert "elsewhere" not in out


def test_a_test_over_part_of_the_users_is_labelled_and_kept_apart_from_full_tests(tmp_path, capsys):
    """``limit_test_batches`` tests a share of the users: its means are not comparable with a full test's, so
    the report says so and neither run's report shows the other."""
    full = fit_and_test(tmp_path, SASRecRecommender(**SMALL_SASREC), RankingReport(name="SASRec-full"), epochs=1)
    full_data = json.loads((Path(full.log_dir) / "ranking.json").read_text())["data"]
    assert "tested on" not in full_data
    capsys.readouterr()
    pl.seed_everything(0, verbose=False)
    trainer = _trainer(tmp_path, RankingReport(name="SASRec-part"), epochs=1)
    data = small_data(negatives=0)
    trainer.fit(SASRecRecommender(**SMALL_SASREC), data)
    trainer.limit_test_batches = 1
    trainer.test(trainer.lightning_module, datamodule=data, verbose=False)
    out = capsys.readouterr().out
    report = out[out.index("test (") :]
    batches = len(data.test_dataloader())
    assert batches > 1
    assert f"tested on 1 of {batches} test batches" in report.splitlines()[0]
    assert "SASRec-full" not in report  # the full test's run is not set beside this one
    part = json.loads((Path(trainer.log_dir) / "ranking.json").read_text())
    assert part["data"] == f"{full_data}; tested on 1 of {batches} test batches"
