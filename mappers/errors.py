"""Errors raised by mappers/."""


class MapperError(Exception):
    """Base class of mapper errors; subclasses say what the caller should do."""
