"""MovieLens as user histories: ML-100K fetched on first use, ML-1M and ML-20M from a local GroupLens folder.

ML-100K's licence forbids redistributing it, so it is not in this repository: the first use fetches the
``recbole`` 1.2.1 wheel from PyPI (which ships ``dataset_example/ml-100k/ml-100k.inter``) and keeps that
one file in a cache folder (``$LIGHTNING_HSTU_CACHE``, default ``~/.cache/lightning-hstu``).
"""

import os
import subprocess
import sys
import tempfile
import zipfile
from collections import defaultdict
from pathlib import Path

from .histories import History, HistoryDataModule

DATASETS = ("ml-100k", "ml-1m", "ml-20m")
_RECBOLE = "recbole==1.2.1"
_MEMBER = "recbole/dataset_example/ml-100k/ml-100k.inter"


class MovieLens(HistoryDataModule):
    """Each user's ratings in time order; the action of an event is its rating (half-stars for ML-20M).

    ``root``: a GroupLens folder (``u.data`` for ML-100K, ``ratings.dat`` for ML-1M, ``ratings.csv`` for
    ML-20M); None fetches ML-100K as described above.
    """

    def __init__(self, dataset: str = "ml-100k", root: str | None = None, **kwargs):
        super().__init__(**kwargs)
        if dataset not in DATASETS:
            raise ValueError(f"unknown MovieLens dataset {dataset!r}; valid: {', '.join(DATASETS)}")
        if root is None and dataset != "ml-100k":
            raise ValueError(f"{dataset} is read from a local GroupLens folder: pass root=... "
                             f"(only ml-100k is fetched automatically)")
        self.dataset, self.root = dataset, root

    def load(self) -> list[History]:
        return histories_from(read_ratings(self.dataset, self.root))


def read_ratings(dataset: str, root: str | None) -> list[tuple[int, int, float, int]]:
    """(user, item, rating, timestamp) rows of a MovieLens file."""
    if root is None:
        path, separator, skip = fetch_ml100k(), "\t", 1
    else:
        name, separator, skip = {"ml-100k": ("u.data", "\t", 0), "ml-1m": ("ratings.dat", "::", 0),
                                 "ml-20m": ("ratings.csv", ",", 1)}[dataset]
        path = Path(root) / name
        if not path.exists():
            raise FileNotFoundError(f"{dataset}: no {name} in {root}")
    rows = []
    with open(path) as lines:
        for line in list(lines)[skip:]:
            user, item, rating, time = line.strip().split(separator)[:4]
            rows.append((int(user), int(item), float(rating), int(float(time))))
    return rows


def histories_from(rows: list[tuple[int, int, float, int]]) -> list[History]:
    """Group ratings by user in time order; ids renumbered from 1 (0 means no item); rating -> action class."""
    items = {item: index + 1 for index, item in enumerate(sorted({r[1] for r in rows}))}
    half_stars = any(r[2] != int(r[2]) for r in rows)
    events = defaultdict(list)
    for user, item, rating, time in rows:
        action = int(round(rating * 2)) - 1 if half_stars else int(rating) - 1
        events[user].append((time, items[item], action))
    histories = []
    for number, user in enumerate(sorted(events), start=1):
        ordered = sorted(events[user])
        histories.append(History(number, tuple(e[1] for e in ordered), tuple(e[2] for e in ordered),
                                 tuple(e[0] for e in ordered)))
    return histories


def fetch_ml100k() -> Path:
    cache = Path(os.environ.get("LIGHTNING_HSTU_CACHE", Path.home() / ".cache" / "lightning-hstu")) / "ml-100k"
    target = cache / "ml-100k.inter"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as download:
        result = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", _RECBOLE, "-d", download],
                                capture_output=True, text=True)
        wheels = list(Path(download).glob("recbole-*.whl"))
        if result.returncode or not wheels:
            raise RuntimeError(f"could not fetch ML-100K (the {_RECBOLE} wheel from PyPI): {result.stderr[-500:]}\n"
                               f"Download ml-100k from GroupLens yourself and pass root=<folder with u.data>.")
        with zipfile.ZipFile(wheels[0]) as wheel:
            partial = target.with_suffix(".part")
            partial.write_bytes(wheel.read(_MEMBER))
            partial.rename(target)
    return target
