"""Checks of numeric constructor arguments, each error naming the argument and its value."""


def at_least(minimum: float, **values: float | None) -> None:
    """Every value given (None: unset, not checked) is at least ``minimum``."""
    for name, value in values.items():
        if value is not None and value < minimum:
            raise ValueError(f"{name} must be at least {minimum}, got {value!r}")


def positive(**values: float) -> None:
    for name, value in values.items():
        if not value > 0:
            raise ValueError(f"{name} must be greater than 0, got {value!r}")
