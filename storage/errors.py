"""Errors raised by storage/."""


class StorageError(Exception):
    """Base class of storage errors; subclasses say what the caller should do."""
