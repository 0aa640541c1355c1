"""The error every bad plan raises."""


class PlanError(ValueError):
    """A plan that cannot run. The message names the culprit and the valid choices."""
