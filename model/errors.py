"""Errors raised by model/."""


class ModelError(Exception):
    """Base class of model errors; subclasses say what the caller should do."""
