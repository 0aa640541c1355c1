"""Data under faults: ids outside their embedding table are refused with the feature, the id and the table
size (never looked up as row 0), ids below 1 and float values as histories load, batches the model would
misread (keys, per-sample counts, negatives, histories longer than max_seq_len) with what is wrong, and
MovieLens files that are truncated, empty, HTML or binary are refused naming the file and line; the first-use
download takes a wheel only, checks its SHA-256, and runs once while other processes wait."""

import hashlib
import multiprocessing
import os
import shutil
import tarfile
import time
import zipfile
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torchrec import EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_runs import QUIET
from ranks import run_on_ranks
from small_hstu import SMALL_MODEL, small_data

from lightning_hstu import HSTUPipelineStrategy, TaskError
from lightning_hstu.data import movielens
from lightning_hstu.data.histories import History, HistoryDataModule
from lightning_hstu.data.movielens import DataFileError, read_ratings
from lightning_hstu.hstu.batch import HSTUBatch, IdError
from lightning_hstu.hstu.sparse import ShardedEmbeddings
from lightning_hstu.models.hstu import HSTURecommender


def fit_hstu(model_kwargs=None, data=None):
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        strategy=HSTUPipelineStrategy("default_d6"),
        accelerator="cpu",
        devices=1,
        max_steps=4,
        **QUIET,
        limit_val_batches=0,
    )
    trainer.fit(HSTURecommender(**{**SMALL_MODEL, **(model_kwargs or {})}), data or small_data())


# ----- ids outside their table ---------------------------------------------------------------------------------


class CraftedHistories(HistoryDataModule):
    """Twenty users of four events; user 7's second item id is ``bad_item`` (in its training history:
    leave-two-out holds the last two out)."""

    def __init__(self, bad_item: int):
        super().__init__(batch_size=4, max_seq_len=8, negatives=2)
        self.bad_item = bad_item

    def load(self):
        histories = []
        for user in range(1, 21):
            items = (1 + user % 9, self.bad_item if user == 7 else 2, 3, 4)
            histories.append(History(user, items, (1, 2, 3, 4), (10, 20, 30, 40)))
        return histories


@pytest.mark.parametrize("bad_item", [-3, 0])
def test_an_item_id_below_1_in_the_data_is_refused_at_setup_naming_the_user(bad_item):
    """Negative ids fall outside the table; id 0 means none (a padding id, a missing target): an item 0 would be
    left out of the loss as a target and counted as no target in the evaluation."""
    with pytest.raises(IdError, match=rf"user 7's history has item id {bad_item}: item ids count from 1"):
        CraftedHistories(bad_item=bad_item).setup()


def test_a_fit_on_data_with_a_bad_id_stops_there():
    with pytest.raises(IdError, match="user 7's history has item id -3"):
        fit_hstu(data=CraftedHistories(bad_item=-3))


def test_a_batch_with_an_id_outside_its_table_is_refused_where_it_is_built():
    """Ids that pass the data module's setup but not the model's tables (here a table of 4 items set on the
    loader's collate) are refused as the batch is built, naming the feature, the id, the user and the table."""
    data = CraftedHistories(bad_item=2)
    data.setup()
    data.num_items = 3  # the tables the loader checks against: items 1 to 3
    with pytest.raises(IdError, match=r"feature 'item' has id \d+ \(user \d+\), outside its embedding table of 4 rows"):
        list(data.train_dataloader())


def test_a_model_whose_item_table_is_smaller_than_the_data_is_refused():
    data = small_data()
    with pytest.raises(IdError) as info:
        fit_hstu(model_kwargs={"num_items": 50}, data=data)
    assert "num_items=50" in str(info.value) and f"{data.num_items}" in str(info.value)


def test_a_history_longer_than_the_model_s_max_seq_len_is_refused_naming_it():
    """The model's max_seq_len sizes the fused kernel's grid and the position tables. A longer history (a
    data module of 32 events under a model of 8, with the padded attention, which the setup's comparison of
    the two lengths leaves alone) is an error that names it, not a step that trains on a part of it (the
    fused kernel would leave its later tokens' outputs unwritten)."""
    with pytest.raises(
        TaskError, match=r"sample \d+ of the batch has a history of \d+ events, longer than the model's max_seq_len=8"
    ):
        fit_hstu(model_kwargs={"max_seq_len": 8, "attention": "padded"})


def _lookup_out_of_range(rank, world):
    table = EmbeddingConfig(name="item", embedding_dim=4, num_embeddings=10, feature_names=["item"])
    embeddings = ShardedEmbeddings([table], torch.device("cpu"))
    outcome = {}
    for ids in ([1, 2, 12], [1, -3, 2]):
        features = KeyedJaggedTensor.from_lengths_sync(
            keys=["item"], values=torch.tensor(ids), lengths=torch.tensor([1, 2])
        )
        try:
            embeddings(features)
            outcome[f"checked {ids}"] = "looked up"
        except IdError as error:
            outcome[f"checked {ids}"] = str(error)
        try:  # past our check: fbgemm's own bounds check must fail, not look up row 0
            embeddings.model_parallel(features)
            outcome[f"fbgemm {ids}"] = "looked up"
        except RuntimeError as error:
            outcome[f"fbgemm {ids}"] = str(error)
    return outcome


def test_the_lookup_refuses_ids_outside_the_table(tmp_path):
    (outcome,) = run_on_ranks(_lookup_out_of_range, tmp_path, world=1)
    assert "feature 'item' has id 12 (sample 1)" in outcome["checked [1, 2, 12]"]
    assert "table of 10 rows" in outcome["checked [1, 2, 12]"]
    assert "feature 'item' has id -3 (sample 1)" in outcome["checked [1, -3, 2]"]
    assert outcome["fbgemm [1, 2, 12]"] != "looked up" and outcome["fbgemm [1, -3, 2]"] != "looked up"


# ----- MovieLens files ---------------------------------------------------------------------------------------

RATINGS = "".join(f"{user}\t{10 + user % 7}\t{1 + user % 5}\t{881250949 + user}\n" for user in range(1, 21))
HTML = "<!DOCTYPE html>\n<html><head><title>404 Not Found</title></head></html>\n"
CUT = RATINGS.index("\n", len(RATINGS) // 2) - 3  # about half way, inside a timestamp: the cut line still parses


@pytest.mark.parametrize(
    "content, problem",
    [
        (RATINGS + "7\tten\t3\t100\n" + RATINGS, "u.data, line 21: expected user, item, rating and timestamp"),
        (RATINGS[:CUT], f"u.data ends in the middle of line {RATINGS[:CUT].count(chr(10)) + 1} "),
        ("", "u.data is empty"),
        (HTML, "u.data, line 1: expected user, item, rating and timestamp"),
        (b"\x89PNG\r\n\x1a\n\x00\xff\xfe\x00" * 4, "u.data, line 1: not text"),
    ],
)
def test_a_bad_ratings_file_is_refused_naming_file_and_line(tmp_path, content, problem):
    path = tmp_path / "u.data"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(DataFileError, match=problem):
        read_ratings("ml-100k", str(tmp_path))


def test_a_file_with_a_header_must_start_with_it(tmp_path):
    (tmp_path / "ratings.csv").write_text(HTML)
    with pytest.raises(DataFileError, match="ratings.csv, line 1: expected the header 'userId,movieId,rating,"):
        read_ratings("ml-20m", str(tmp_path))


def test_a_part_of_a_published_dataset_is_read_with_a_warning(tmp_path):
    (tmp_path / "u.data").write_text(RATINGS)
    with pytest.warns(UserWarning, match="holds 20 ratings; the published ml-100k has 100,000"):
        assert len(read_ratings("ml-100k", str(tmp_path))) == 20


INTER = "user_id:token\titem_id:token\trating:float\ttimestamp:float\n" + RATINGS


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LIGHTNING_HSTU_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "ml-100k" / "ml-100k.inter"


def test_a_damaged_cache_file_is_refused_naming_it(cache):
    cache.parent.mkdir(parents=True)
    cache.write_text(HTML)
    with pytest.raises(DataFileError) as info:
        read_ratings("ml-100k", None)
    assert str(cache) in str(info.value) and "Delete it to fetch it again" in str(info.value)


def fake_wheel(directory: Path, inter: str = INTER) -> Path:
    """A wheel named like recbole 1.2.1's, holding ``inter`` where the real one holds ML-100K."""
    wheel = directory / "recbole-1.2.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("recbole/dataset_example/ml-100k/ml-100k.inter", inter)
        archive.writestr("recbole-1.2.1.dist-info/METADATA", "Metadata-Version: 2.1\nName: recbole\nVersion: 1.2.1\n")
        archive.writestr(
            "recbole-1.2.1.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        archive.writestr("recbole-1.2.1.dist-info/RECORD", "")
    return wheel


def hostile_sdist(directory: Path, marker: Path) -> None:
    """recbole 1.2.1 as an sdist whose build backend, run by pip to read its metadata, leaves a marker."""
    source = directory / "src" / "recbole-1.2.1"
    source.mkdir(parents=True)
    (source / "pyproject.toml").write_text(
        '[build-system]\nrequires = []\nbuild-backend = "backend"\nbackend-path = ["."]\n'
    )
    (source / "backend.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n")
    (source / "PKG-INFO").write_text("Metadata-Version: 2.1\nName: recbole\nVersion: 1.2.1\n")
    with tarfile.open(directory / "recbole-1.2.1.tar.gz", "w:gz") as archive:
        archive.add(source, arcname="recbole-1.2.1")


@pytest.fixture
def local_index(tmp_path, monkeypatch):
    """pip finds packages in a local folder only (and no network index)."""
    links = tmp_path / "links"
    links.mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    return links


def test_the_fetch_never_builds_an_sdist(cache, local_index, tmp_path):
    marker = tmp_path / "marker"
    hostile_sdist(local_index, marker)
    with pytest.raises(RuntimeError, match="could not fetch ML-100K"):
        read_ratings("ml-100k", None)
    assert not marker.exists()  # pip never ran the sdist's build code
    assert not cache.exists()


def test_the_fetch_refuses_a_wheel_that_does_not_match_its_recorded_hash(cache, local_index):
    fake_wheel(local_index)
    with pytest.raises(RuntimeError, match="could not fetch ML-100K"):
        read_ratings("ml-100k", None)
    assert not cache.exists()


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_a_wheel_matching_the_recorded_hashes_is_fetched_and_kept(cache, local_index, monkeypatch):
    wheel = fake_wheel(local_index)
    monkeypatch.setattr(movielens, "WHEEL_SHA256", _sha256(wheel.read_bytes()))
    monkeypatch.setattr(movielens, "INTER_SHA256", _sha256(INTER.encode()))
    assert len(read_ratings("ml-100k", None)) == 20  # real pip, from the local folder
    assert cache.read_text() == INTER
    monkeypatch.setattr(movielens, "download_wheel", lambda directory: pytest.fail("fetched twice"))
    assert len(read_ratings("ml-100k", None)) == 20


def _fetch_in_a_process() -> None:
    movielens.fetch_ml100k()


def test_processes_that_need_the_file_at_once_download_it_once(cache, tmp_path, monkeypatch):
    wheel = fake_wheel(tmp_path)
    log = tmp_path / "downloads"
    monkeypatch.setattr(movielens, "WHEEL_SHA256", _sha256(wheel.read_bytes()))
    monkeypatch.setattr(movielens, "INTER_SHA256", _sha256(INTER.encode()))

    def download(directory: Path) -> Path:
        with open(log, "a") as file:
            file.write(f"{os.getpid()}\n")
        # give the other process every chance to download too, if nothing stops it
        for _ in range(50):
            if len(log.read_text().splitlines()) > 1:
                break
            time.sleep(0.02)
        return Path(shutil.copy(wheel, directory))

    monkeypatch.setattr(movielens, "download_wheel", download)
    context = multiprocessing.get_context("fork")  # the children inherit the stand-in download
    processes = [context.Process(target=_fetch_in_a_process) for _ in range(3)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(60)
    assert [process.exitcode for process in processes] == [0, 0, 0]
    assert len(log.read_text().splitlines()) == 1
    assert cache.read_text() == INTER


# ----- batches the model would read wrongly ---------------------------------------------------------------


def _batch(lengths: dict[str, list[int]]) -> HSTUBatch:
    """A batch keyed as ``lengths`` (key -> per-sample lengths), ids 1, 2, ... (times 10, 20, ...)."""
    values = torch.arange(1, 1 + sum(sum(n) for n in lengths.values()))
    features = KeyedJaggedTensor.from_lengths_sync(
        keys=list(lengths), values=values, lengths=torch.tensor([n for ns in lengths.values() for n in ns])
    )
    return HSTUBatch(features, sequence_keys=("item", "action", "time"))


GOOD = dict(item=[3, 2], item_neg=[4, 4], action=[3, 2], user=[1, 1], time=[3, 2])

BAD_BATCHES = {  # (lengths, retrieval loss) -> what the error says
    "keys in another order": (
        dict(item=[3, 2], action=[3, 2], item_neg=[4, 4], user=[1, 1], time=[3, 2]),
        "sampled",
        r"keyed \['item', 'action', 'item_neg', 'user', 'time'\]: HSTURecommender needs item, item_neg, action, user",
    ),
    "no time key": (dict(item=[3, 2], item_neg=[4, 4], action=[3, 2], user=[1, 1]), "sampled", "and a 'time' key"),
    "actions per sample that differ from the items (same total)": (
        {**GOOD, "action": [2, 3]},
        "sampled",
        r"sample 0 of the batch has 3 items but 2 'action' values",
    ),
    "times per sample that differ from the items": (
        {**GOOD, "time": [3, 1]},
        "full",
        r"sample 1 of the batch has 2 items but 1 'time' values",
    ),
    "two user ids on one sample, none on the other": (
        {**GOOD, "user": [2, 0]},
        "sampled",
        r"sample 0 of the batch has 2 'user' ids: each history needs one",
    ),
    "negatives in uneven numbers": ({**GOOD, "item_neg": [3, 5]}, "sampled", r"this batch has \[3, 5\] per sample"),
    "no negatives for the sampled softmax": ({**GOOD, "item_neg": [0, 0]}, "sampled", r"this batch has \[0\] per"),
}


@pytest.mark.parametrize("case", list(BAD_BATCHES))
def test_a_batch_the_model_would_misread_is_refused_naming_what_is_wrong(case):
    lengths, retrieval, message = BAD_BATCHES[case]
    model = HSTURecommender(**SMALL_MODEL, retrieval_loss=retrieval)
    with pytest.raises(ValueError, match=message):
        model.objectives.check_batch(_batch(lengths))


def test_batches_the_model_reads_rightly_pass_the_check():
    """The loader's layout; uneven or no negatives where nothing reads them (the full softmax, evaluation)."""
    for retrieval, lengths, training in [
        ("sampled", GOOD, True),
        ("full", {**GOOD, "item_neg": [0, 7]}, True),
        ("sampled", {**GOOD, "item_neg": [0, 0], "target": [1, 1]}, False),
    ]:
        HSTURecommender(**SMALL_MODEL, retrieval_loss=retrieval).objectives.check_batch(_batch(lengths), training)
    data = small_data()
    data.setup()
    HSTURecommender(**SMALL_MODEL).objectives.check_batch(next(iter(data.train_dataloader())))


class FloatTimes(CraftedHistories):
    def load(self):
        return [History(h.user, h.items, h.actions, tuple(t + 0.5 for t in h.times)) for h in super().load()]


def test_histories_with_float_times_are_refused_where_the_batch_is_built():
    """A float among the values would make the batch's ids and times float32 (times of about 1.7e9 lose gaps of
    up to 128 s); they are refused, not truncated."""
    data = FloatTimes(bad_item=2)
    data.setup()
    with pytest.raises(ValueError, match=r"History times \(seconds\) must be integers, got torch.float32 values"):
        next(iter(data.train_dataloader()))


class TenActions(CraftedHistories):
    def load(self):
        return [History(h.user, h.items, (0, 9, 3, 4), h.times) for h in super().load()]


def test_a_ranking_head_smaller_than_the_data_s_actions_is_refused():
    with pytest.raises(
        ValueError, match=r"the data's actions go up to 9 \(10 classes\), but the ranking head predicts 5"
    ):
        fit_hstu(data=TenActions(bad_item=2))
    fit_hstu(model_kwargs={"num_actions": 10}, data=TenActions(bad_item=2))  # as the message says


class ListHistories(CraftedHistories):
    def load(self):
        return [History(h.user, list(h.items), list(h.actions), list(h.times)) for h in super().load()]


def test_histories_of_lists_are_refused_at_setup_naming_the_user_and_the_field():
    """``History.last`` adds a history's cut items to its ``earlier`` tuple: items as a list stopped the setup in
    that addition (``can only concatenate tuple (not "list") to tuple``), items as a numpy array in numpy's
    broadcasting, neither naming the history nor what it should be."""
    with pytest.raises(TypeError, match=r"user 1's history has its items as a list: History takes tuples"):
        ListHistories(bad_item=2).setup()


class NoEvents(HistoryDataModule):
    def load(self):
        return [History(1, (), (), ())]


def test_a_load_with_no_events_is_refused_naming_the_data_module():
    """The table sizes are the data's largest ids: with no event the setup stopped at 'max() iterable argument
    is empty'."""
    with pytest.raises(ValueError, match=r"NoEvents.load\(\) returned 1 histories and no event"):
        NoEvents().setup()
