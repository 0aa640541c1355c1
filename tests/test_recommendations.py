"""Recommendations: ``RankingEvaluation.predict_step`` over ``HistoryDataModule.predict_dataloader``, written
by ``callbacks.RecommendationWriter`` (what ``lightning-hstu predict`` leaves behind)."""

import csv
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from lightning_runs import QUIET, SharedDirectoryLogger
from ranks import run_script
from small_hstu import model_and_data

from lightning_hstu import HSTUPipelineStrategy
from lightning_hstu.callbacks import RecommendationWriter
from lightning_hstu.data.histories import Collate
from lightning_hstu.data.movielens import MovieLens
from lightning_hstu.models.hstu import HSTURecommender

SCRIPTS = Path(__file__).parent / "scripts"


def _trained(tmp_path, writer, *callbacks, accelerator="cpu", max_steps=3, data=None, **data_kwargs):
    """The small model trained ``max_steps`` on ``data`` (default: the small synthetic histories of 40 users,
    with ``data_kwargs``) under default_d6, ``writer`` and ``callbacks`` on its Trainer."""
    pl.seed_everything(0, verbose=False)
    model_kwargs, make_data = model_and_data(accelerator)
    model = HSTURecommender(**model_kwargs)
    data = data if data is not None else make_data(**{"num_users": 40, **data_kwargs})
    options = {**QUIET, "logger": pl.loggers.CSVLogger(tmp_path), "enable_checkpointing": bool(callbacks)}
    trainer = pl.Trainer(
        strategy=HSTUPipelineStrategy("default_d6"),
        accelerator=accelerator,
        devices=1,
        max_steps=max_steps,
        callbacks=[writer, *callbacks],
        **options,
    )
    trainer.fit(model, data)
    return model, data, trainer


def _read(path) -> dict[int, list[tuple[int, float]]]:
    by_user: dict[int, list[tuple[int, float]]] = {}
    with open(path, newline="") as file:
        rows = list(csv.reader(file))
    assert rows[0] == ["user", "rank", "item", "score"]
    for user, rank, item, score in rows[1:]:
        by_user.setdefault(int(user), []).append((int(item), float(score)))
        assert int(rank) == len(by_user[int(user)])
    return by_user


def _expected(model, data, history, k, seen_items):
    """The model's k best items after ``history``, scored on their own (a batch of one)."""
    batch = Collate(data.num_items, 0, 0, rows=data.table_rows())([history]).to(model.device)
    with torch.no_grad():
        scores = model.score_items(batch)[0].float()
    scores[0] = -torch.inf
    if not seen_items:
        scores[list(history.items + history.earlier)] = -torch.inf
    best = scores.topk(k)
    return best.indices.tolist(), best.values.tolist()


@pytest.mark.parametrize("seen_items", [False, True])
def test_predict_writes_each_users_best_items_after_their_whole_history(tmp_path, seen_items):
    writer = RecommendationWriter(top_k=5, seen_items=seen_items)
    model, data, trainer = _trained(tmp_path, writer)
    trainer.predict(model, datamodule=data)
    assert writer.path == tmp_path / "lightning_logs" / "version_0" / "recommendations.csv"
    got = _read(writer.path)
    assert sorted(got) == sorted(h.user for h in data.latest)  # every user once
    model.eval()
    for history in data.latest:
        items, scores = _expected(model, data, history, 5, seen_items)
        assert [item for item, _ in got[history.user]] == items
        assert [score for _, score in got[history.user]] == pytest.approx(scores, rel=1e-5, abs=1e-6)
        if not seen_items:
            assert not set(items) & set(history.items + history.earlier)


def test_predict_writes_the_files_user_and_movie_ids(tmp_path):
    """MovieLens renumbers users and movies from 1 for the tables; the file names the dataset's ids (users 10,
    20, ...; movies 7, 107, ...), which on ML-1M or ML-20M (movie ids with gaps) differ from the model's."""
    root = tmp_path / "ml"
    root.mkdir()
    gen = torch.Generator().manual_seed(0)
    lines = [
        f"{10 * user}\t{7 + 100 * int(movie)}\t{1 + int(rating)}\t{1000 * user + t}\n"
        for user in range(1, 13)
        for t, (movie, rating) in enumerate(zip(torch.randperm(40, generator=gen)[:8], torch.randint(0, 5, (8,))))
    ]
    (root / "u.data").write_text("".join(lines))
    writer = RecommendationWriter(top_k=5)
    model, data, trainer = _trained(
        tmp_path, writer, max_steps=2, data=MovieLens(root=str(root), batch_size=4, negatives=4)
    )
    trainer.predict(model, datamodule=data)
    got = _read(writer.path)
    assert sorted(got) == [10 * user for user in range(1, 13)]
    model.eval()
    for history in data.latest:
        items, _ = _expected(model, data, history, 5, seen_items=False)
        assert [item for item, _ in got[data.user_ids[history.user]]] == [data.item_ids[i] for i in items]
        assert all(item % 100 == 7 for item, _ in got[data.user_ids[history.user]])


def test_without_a_logger_predict_writes_beside_a_users_file_not_over_it(tmp_path):
    writer = RecommendationWriter(top_k=2)
    model, data, _ = _trained(tmp_path, writer)
    (tmp_path / "recommendations.csv").write_text("the user's own file")
    trainer = pl.Trainer(
        strategy=HSTUPipelineStrategy("default_d6"),
        accelerator="cpu",
        devices=1,
        default_root_dir=tmp_path,
        callbacks=[writer],
        **QUIET,
    )
    trainer.predict(model, datamodule=data)
    assert (tmp_path / "recommendations.csv").read_text() == "the user's own file"
    assert writer.path == tmp_path / "recommendations-v1.csv"
    assert len(_read(writer.path)) == len(data.latest)


def test_predict_recommends_after_the_test_item(tmp_path):
    """The histories predicted from are the whole ones: the held-out validation and test items included."""
    _, data, _ = _trained(tmp_path, RecommendationWriter())
    tests = {history.user: (history, item) for history, item in data.test}
    for history in data.latest:
        if history.user in tests:
            before, item = tests[history.user]
            assert history.items[-1] == item
            kept = len(history.items) - 1  # the last max_seq_len events: one fewer before the test item
            assert history.items[:-1] == before.items[len(before.items) - kept :]


def test_a_user_who_has_seen_almost_everything_gets_only_the_items_left(tmp_path):
    writer = RecommendationWriter(top_k=5)
    model, data, trainer = _trained(tmp_path, writer, num_items=30)
    greedy = data.latest[0]
    everything = tuple(range(3, data.num_items + 1))  # every item but 1 and 2
    assert len(everything) <= data.max_seq_len
    data.latest = [type(greedy)(greedy.user, everything, (0,) * len(everything), tuple(range(len(everything))))]
    trainer.predict(model, datamodule=data)
    assert sorted(item for item, _ in _read(writer.path)[greedy.user]) == [1, 2]


def test_items_before_a_history_cut_to_max_seq_len_are_not_recommended_again(tmp_path):
    """A user who rated more than ``max_seq_len`` items: the model reads the last ones, and the earlier ones
    are still seen (before, they were recommended: on ML-100K 257 of 9,430 rows, 9 of user 18's 10)."""
    writer = RecommendationWriter(top_k=5)
    model, data, trainer = _trained(tmp_path, writer, num_items=30)
    everything = tuple(range(3, data.num_items + 1))  # every item but 1 and 2, the last 10 in the window
    whole = type(data.latest[0])(7, everything, (0,) * len(everything), tuple(range(len(everything))))
    data.latest = [whole.last(10)]
    assert len(data.latest[0].items) == 10 and len(data.latest[0].earlier) == len(everything) - 10
    trainer.predict(model, datamodule=data)
    assert sorted(item for item, _ in _read(writer.path)[7]) == [1, 2]


def test_predict_from_a_checkpoint_recommends_with_its_weights(tmp_path):
    writer, checkpoint = RecommendationWriter(top_k=5), pl.callbacks.ModelCheckpoint(tmp_path / "ckpt")
    model, data, trainer = _trained(tmp_path, writer, checkpoint)
    trainer.predict(model, datamodule=data)
    trained = _read(writer.path)
    with torch.no_grad():  # other weights in the live model: dense layers and the tables' shards
        for weight in model.evaluation_weights():
            weight.normal_()
    trainer.predict(model, datamodule=data)
    assert _read(writer.path) != trained
    trainer.predict(model, datamodule=data, ckpt_path=checkpoint.best_model_path)
    assert _read(writer.path) == trained


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_predict_on_a_gpu_recommends_the_models_best_unseen_items(tmp_path):
    """The fused attention on the GPU, batches of histories of every length: each user's recommendations are
    the items the model scores best after that history alone (a batch of one)."""
    writer = RecommendationWriter(top_k=5)
    model, data, trainer = _trained(tmp_path, writer, accelerator="gpu", max_steps=4, num_users=100)
    trainer.predict(model, datamodule=data)
    got = _read(writer.path)
    assert sorted(got) == sorted(h.user for h in data.latest)
    model.to(torch.device("cuda")).eval()  # Lightning's teardown moved the dense part to the CPU
    for history in data.latest:
        items, scores = _expected(model, data, history, 5, False)
        assert [score for _, score in got[history.user]] == pytest.approx(scores, rel=1e-4, abs=1e-5)
        assert not {item for item, _ in got[history.user]} & set(history.items)


def test_bad_top_k_is_refused():
    with pytest.raises(ValueError, match="top_k must be at least 1, got 0"):
        RecommendationWriter(top_k=0)


def test_two_ranks_write_one_file_with_every_user_once(tmp_path):
    """41 users on two ranks: shares of 21 and 20 histories, the shorter filled up with a filler history,
    which is not written; rank 0 writes every user's recommendations, gathered from both ranks."""
    result = run_script(SCRIPTS / "recommend_ranks.py", tmp_path, tmp_path, 41, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    saved = torch.load(tmp_path / "users.pt", weights_only=False)
    got = _read(saved["path"])
    assert sorted(got) == sorted(saved["histories"]) and len(got) == 41
    for user, recommended in got.items():
        items = [item for item, _ in recommended]
        scores = [score for _, score in recommended]
        assert len(items) == 4 and 0 not in items and not set(items) & set(saved["histories"][user])
        assert scores == sorted(scores, reverse=True)


def test_a_logger_without_a_run_directory_of_its_own_never_gets_an_earlier_file_written_over(tmp_path):
    """With a WandbLogger (save_dir ".") predict wrote ./recommendations.csv over whatever was there: a user's
    file, the recommendations of an earlier run."""
    writer = RecommendationWriter(top_k=2)
    model, data, _ = _trained(tmp_path / "fit", writer)
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "recommendations.csv").write_text("an earlier run's recommendations")
    trainer = pl.Trainer(
        strategy=HSTUPipelineStrategy("default_d6"),
        accelerator="cpu",
        devices=1,
        callbacks=[writer],
        **{**QUIET, "logger": SharedDirectoryLogger(shared)},
    )
    trainer.predict(model, datamodule=data, return_predictions=False)
    assert (shared / "recommendations.csv").read_text() == "an earlier run's recommendations"
    assert writer.path == shared / "recommendations-v1.csv"
    assert len(_read(writer.path)) == len(data.latest)


def test_a_write_that_fails_half_way_leaves_no_partial_file(tmp_path, monkeypatch):
    """A disk that fills up (or a process killed) while the rows are written: before, a truncated
    recommendations.csv stayed under the file's name, header and all, like a finished one."""
    import csv
    import errno

    writer = RecommendationWriter(top_k=2)
    model, data, trainer = _trained(tmp_path, writer)
    make_writer = csv.writer

    class FillsTheDisk:
        def __init__(self, file, *args, **kwargs):
            self.rows = make_writer(file, *args, **kwargs)

        def writerow(self, row):
            self.rows.writerow(row)

        def writerows(self, rows):
            rows = list(rows)
            self.rows.writerows(rows[: len(rows) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(csv, "writer", FillsTheDisk)
    with pytest.raises(OSError, match="No space left"):
        trainer.predict(model, datamodule=data, return_predictions=False)
    run_dir = tmp_path / "lightning_logs" / "version_0"
    assert not list(run_dir.glob("*recommendations*")), list(run_dir.iterdir())  # nothing half-written
    monkeypatch.setattr(csv, "writer", make_writer)
    trainer.predict(model, datamodule=data, return_predictions=False)
    assert writer.path == run_dir / "recommendations.csv"
    assert len(_read(writer.path)) == len(data.latest)


def test_scores_that_are_not_a_number_raise_and_write_no_file(tmp_path):
    """A model whose weights went non-finite scores NaN, which ``topk`` ranks above every item: the file
    would hold fewer or no items for those users, with nothing said."""
    writer = RecommendationWriter(top_k=2)
    model, data, trainer = _trained(tmp_path, writer)
    score_items = model.score_items

    def some_not_a_number(batch):
        scores = score_items(batch)
        scores[::2] = float("nan")
        return scores

    model.score_items = some_not_a_number
    with pytest.raises(ValueError, match=r"scored NaN for \d+ users .* no recommendations written"):
        trainer.predict(model, datamodule=data, return_predictions=False)
    assert writer.path is None
    assert not list((tmp_path / "lightning_logs" / "version_0").glob("*recommendations*"))
    model.score_items = score_items
    trainer.predict(model, datamodule=data, return_predictions=False)  # the next predict starts afresh
    assert len(_read(writer.path)) == len(data.latest)
