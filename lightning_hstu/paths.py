"""File names that never replace a file already there (a user's, or another run's)."""

from pathlib import Path


def unused(path: Path) -> Path:
    """``path``, or ``<stem>-v1<suffix>``, ``-v2``... if taken."""
    version = 0
    candidate = path
    while candidate.exists():
        version += 1
        candidate = path.with_name(f"{path.stem}-v{version}{path.suffix}")
    return candidate
