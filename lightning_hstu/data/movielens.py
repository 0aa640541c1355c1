"""MovieLens as user histories: ML-100K fetched on first use, ML-1M and ML-20M from a local GroupLens folder.

ML-100K's licence forbids redistributing it, so it is not in this repository: the first use fetches the
``recbole`` 1.2.1 wheel from PyPI (which ships ``dataset_example/ml-100k/ml-100k.inter``) and keeps that
one file in a cache folder (``$LIGHTNING_HSTU_CACHE``, default ``~/.cache/lightning-hstu``). The wheel is
taken as a binary only (an sdist would run its build code) and must match its recorded SHA-256, as must
the extracted file, at every use. One process fetches while the others wait (a file lock; under Lightning
``prepare_data`` runs it on one rank per node first).

Every file is parsed strictly: a line that is not a rating, a file that ends in the middle of a line
(truncated), an empty, HTML or binary file raise ``DataFileError`` naming the file and the line.
"""

import contextlib
import fcntl
import hashlib
import os
import subprocess
import sys
import tempfile
import warnings
import zipfile
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .histories import History, HistoryDataModule

DATASETS = ("ml-100k", "ml-1m", "ml-20m")
_RECBOLE = "recbole==1.2.1"
_MEMBER = "recbole/dataset_example/ml-100k/ml-100k.inter"
WHEEL_SHA256 = "9c9948202011f37eb0a7c6768129313f00d6403ad221ec940d5e2d5d5f33a407"
"""recbole-1.2.1-py3-none-any.whl as PyPI serves it."""
INTER_SHA256 = "4edb74e2a81178c2ba9ff381495f754f996c4aea351b1272ca36b43da0935eff"
"""Its ml-100k.inter: the 100,000 ratings of ML-100K under a header line."""


class DataFileError(ValueError):
    """A data file that is not what its format says: the message names the file and, where it applies, the
    line."""


@dataclass(frozen=True)
class RatingsFormat:
    file: str
    separator: str
    header: str | None
    """The exact first line, for formats that have one."""
    published: int | None
    """How many ratings the published dataset holds."""
    half_stars: bool = False
    """Ratings 0.5, 1.0, ..., 5.0 (ten action classes) rather than 1, 2, ..., 5 (five)."""

    @property
    def ratings(self) -> tuple[float, ...]:
        """The ratings the dataset uses, in the order of their action classes."""
        return tuple(half / 2 for half in range(1, 11)) if self.half_stars else (1.0, 2.0, 3.0, 4.0, 5.0)


FORMATS = {
    "ml-100k": RatingsFormat("u.data", "\t", None, 100_000),
    "ml-1m": RatingsFormat("ratings.dat", "::", None, 1_000_209),
    "ml-20m": RatingsFormat("ratings.csv", ",", "userId,movieId,rating,timestamp", 20_000_263, half_stars=True),
}
FETCHED = RatingsFormat("ml-100k.inter", "\t", "user_id:token\titem_id:token\trating:float\ttimestamp:float", 100_000)


class MovieLens(HistoryDataModule):
    """Each user's ratings in time order; the action of an event is its rating (half-stars for ML-20M).

    ``root``: a GroupLens folder (``u.data`` for ML-100K, ``ratings.dat`` for ML-1M, ``ratings.csv`` for
    ML-20M); None fetches ML-100K as described above.

    Users and movies are renumbered from 1 in the order of their ids (the tables' rows); ``user_ids`` and
    ``item_ids`` (set by ``setup``) give the file's id of each: ``item_ids[i]`` is the movie the model calls
    ``i`` (index 0: no item). Recommendations are written with the file's ids.
    """

    def __init__(self, dataset: str = "ml-100k", root: str | None = None, **kwargs):
        super().__init__(**kwargs)
        if dataset not in DATASETS:
            raise ValueError(f"unknown MovieLens dataset {dataset!r}; valid: {', '.join(DATASETS)}")
        if root is None and dataset != "ml-100k":
            raise ValueError(
                f"{dataset} is read from a local GroupLens folder: pass root=... "
                f"(only ml-100k is fetched automatically)"
            )
        self.dataset, self.root = dataset, root

    def prepare_data(self) -> None:
        # Lightning runs this on one process per node and the others wait: one fetch per machine.
        if self.root is None:
            fetch_ml100k()

    def load(self) -> list[History]:
        rows = read_ratings(self.dataset, self.root)
        self.user_ids, self.item_ids = renumbering(rows)
        return histories_from(rows, FORMATS[self.dataset].half_stars, (self.user_ids, self.item_ids))

    @property
    def split(self) -> str:
        return f"MovieLens {self.dataset} ({self.counts}), leave-two-out"


def read_ratings(dataset: str, root: str | None) -> list[tuple[int, int, float, int]]:
    """(user, item, rating, timestamp) rows of a MovieLens file."""
    if root is None:
        return parse_ratings(fetch_ml100k(), FETCHED)
    ratings = FORMATS[dataset]
    path = Path(root) / ratings.file
    if not path.exists():
        raise FileNotFoundError(f"{dataset}: no {ratings.file} in {root}")
    rows = parse_ratings(path, ratings)
    if ratings.published is not None and len(rows) != ratings.published:
        warnings.warn(
            f"{path} holds {len(rows):,} ratings; the published {dataset} has {ratings.published:,}: "
            f"training on another version or a part of it",
            stacklevel=2,
        )
    return rows


def parse_ratings(path: Path, ratings: RatingsFormat) -> list[tuple[int, int, float, int]]:
    """Every line of ``path`` as a rating; anything else raises ``DataFileError`` naming file and line."""
    rows = []
    number = 0
    for number, line in _lines(path):
        if number == 1 and ratings.header is not None:
            if line.strip() != ratings.header:
                raise DataFileError(f"{path}, line 1: expected the header {ratings.header!r}, got {line[:80]!r}")
            continue
        rows.append(_rating(line, ratings, path, number))
    if number == 0:
        raise DataFileError(f"{path} is empty")
    if not rows:
        raise DataFileError(f"{path} holds no ratings after its header")
    return rows


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of a UTF-8 text file that ends with a newline."""
    with open(path, "rb") as file:
        for number, raw in enumerate(file, start=1):
            if not raw.endswith(b"\n"):
                raise DataFileError(
                    f"{path} ends in the middle of line {number} ({raw[:80]!r}): the file is "
                    f"truncated. If it is complete, end it with a newline"
                )
            try:
                yield number, raw.decode("utf-8")
            except UnicodeDecodeError:
                raise DataFileError(
                    f"{path}, line {number}: not text ({raw[:40]!r}...): a binary or damaged "
                    f"file where ratings were expected"
                ) from None


def _rating(line: str, ratings: RatingsFormat, path: Path, number: int) -> tuple[int, int, float, int]:
    fields = line.strip().split(ratings.separator)
    try:
        user, item, rating, time = fields
        row = int(user), int(item), float(rating), int(float(time))
    except (ValueError, OverflowError):  # too few or many fields, not numbers, an infinite time
        raise DataFileError(
            f"{path}, line {number}: expected user, item, rating and timestamp separated by "
            f"{ratings.separator!r}, got {line.strip()[:80]!r}"
        ) from None
    if row[2] not in ratings.ratings:
        valid = ", ".join(f"{r:g}" for r in ratings.ratings)
        raise DataFileError(f"{path}, line {number}: rating {rating!r} is not one of this dataset's ({valid})")
    return row


def renumbering(rows: list[tuple[int, int, float, int]]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The file's user and item ids in the order ``histories_from`` numbers them: index ``n`` holds the id
    numbered ``n`` (index 0, which numbers no user and no item, holds 0)."""
    return (0, *sorted({r[0] for r in rows})), (0, *sorted({r[1] for r in rows}))


def histories_from(
    rows: list[tuple[int, int, float, int]],
    half_stars: bool = False,
    ids: tuple[tuple[int, ...], tuple[int, ...]] | None = None,
) -> list[History]:
    """Group ratings by user in time order; ids renumbered from 1 (0 means no item) as ``renumbering`` lists
    them (``ids``: its result, where the caller has it already); rating -> action class (``half_stars``:
    0.5 -> 0 ... 5.0 -> 9, else 1 -> 0 ... 5 -> 4)."""
    user_ids, item_ids = ids if ids is not None else renumbering(rows)
    users = {user: number for number, user in enumerate(user_ids) if number}
    items = {item: number for number, item in enumerate(item_ids) if number}
    events = defaultdict(list)
    for user, item, rating, time in rows:
        action = int(round(rating * 2)) - 1 if half_stars else int(rating) - 1
        events[users[user]].append((time, items[item], action))
    histories = []
    for number in sorted(events):
        ordered = sorted(events[number])
        histories.append(
            History(number, tuple(e[1] for e in ordered), tuple(e[2] for e in ordered), tuple(e[0] for e in ordered))
        )
    return histories


# ----- the first-use fetch of ML-100K ------------------------------------------------------------------------


def fetch_ml100k() -> Path:
    """The cached ``ml-100k.inter``, fetched first if absent; checked against its SHA-256 every time."""
    cache = Path(os.environ.get("LIGHTNING_HSTU_CACHE", Path.home() / ".cache" / "lightning-hstu")) / "ml-100k"
    target = cache / FETCHED.file
    cache.mkdir(parents=True, exist_ok=True)
    with _exclusive(cache / "fetch.lock"):  # one process fetches; the others wait here, then find the file
        if not target.exists():
            _fetch_into(target)
    digest = _sha256(target.read_bytes())
    if digest != INTER_SHA256:
        raise DataFileError(
            f"{target} is not the ML-100K file fetched from {_RECBOLE} (SHA-256 {digest}, "
            f"expected {INTER_SHA256}): it changed or was damaged since. Delete it to fetch it "
            f"again"
        )
    return target


def _fetch_into(target: Path) -> None:
    with tempfile.TemporaryDirectory() as download:
        wheel = download_wheel(Path(download))
        digest = _sha256(wheel.read_bytes())
        if digest != WHEEL_SHA256:
            raise RuntimeError(
                f"{wheel.name} has SHA-256 {digest}, expected {WHEEL_SHA256}: not the {_RECBOLE} "
                f"wheel this release was checked with; refusing it"
            )
        with zipfile.ZipFile(wheel) as archive:
            content = archive.read(_MEMBER)
        if _sha256(content) != INTER_SHA256:
            raise RuntimeError(f"{_MEMBER} in {wheel.name} does not match its recorded SHA-256; refusing it")
        partial = target.with_suffix(".part")
        partial.write_bytes(content)
        partial.rename(target)


def download_wheel(directory: Path) -> Path:
    """The recbole wheel, downloaded by pip into ``directory``: a binary only (an sdist would run its build
    code here), and pip checks it against the recorded hash before keeping it."""
    requirement = directory / "requirement.txt"
    requirement.write_text(f"{_RECBOLE} --hash=sha256:{WHEEL_SHA256}\n")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--require-hashes",
            "-q",
            "-r",
            str(requirement),
            "-d",
            str(directory),
        ],
        capture_output=True,
        text=True,
    )
    wheels = list(directory.glob("recbole-*.whl"))
    if result.returncode or not wheels:
        raise RuntimeError(
            f"could not fetch ML-100K (the {_RECBOLE} wheel from PyPI): {result.stderr[-800:]}\n"
            f"Download ml-100k from GroupLens yourself and pass root=<folder with u.data>."
        )
    return wheels[0]


@contextlib.contextmanager
def _exclusive(lock: Path) -> Iterator[None]:
    with open(lock, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _sha256(content: bytes) -> str:
    return hashlib.sha256(content).hexdigest()
