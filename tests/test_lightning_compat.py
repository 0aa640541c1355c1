"""The loops follow Lightning's private loop code: an installed Lightning that differs from the tested one
in any function they mirror or call fails here, and one outside the tested releases is refused at import
with the range to install."""

import re
from pathlib import Path

import lightning
import pytest

from lightning_hstu.loops import _lightning_compat as compat


def test_the_mirrored_lightning_functions_are_those_the_loops_were_written_against():
    assert compat.changed() == {}, (
        "Lightning changed functions lightning_hstu/loops follows: read them against "
        "loops/ and update loops/_lightning_compat.py"
    )


def test_a_changed_function_is_named(monkeypatch):
    target = next(iter(compat.MIRRORED))
    monkeypatch.setitem(compat.MIRRORED, target, "0" * 64)
    monkeypatch.setitem(compat.MIRRORED, "lightning.pytorch.loops.fetchers:_Gone", "0" * 64)
    changed = compat.changed()
    assert changed[target].startswith("source changed")
    assert changed["lightning.pytorch.loops.fetchers:_Gone"].startswith("not found (AttributeError")


@pytest.mark.parametrize("version", ["2.5.9", "2.7.0", "3.0.0"])
def test_a_lightning_outside_the_tested_releases_is_refused_with_the_range(monkeypatch, version):
    monkeypatch.setattr(lightning, "__version__", version)
    with pytest.raises(
        ImportError,
        match=rf"Lightning {re.escape(version)} is installed: install a release in "
        r"that range \(pip install 'lightning>=2\.6,<2\.7'\)",
    ):
        compat.check_version()


def test_the_package_requires_the_tested_releases():
    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    low, high = (".".join(map(str, v)) for v in compat.TESTED)
    assert f'"lightning>={low},<{high}"' in pyproject
