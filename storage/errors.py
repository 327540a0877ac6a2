"""Errors raised by storage/.

Expected outcomes (a miss, a refused write, a full budget) are typed return values, not exceptions;
these classes are for conditions the caller cannot treat as a normal turn.
"""


class StorageError(Exception):
    """Base class of storage errors; subclasses say what the caller should do."""


class StoreClosedError(StorageError):
    """The store was closed. Open a new one on the same path; everything acknowledged is still there."""


class StoreFormatError(StorageError):
    """The directory holds a database of another on-disk format version. Point the store at an empty
    directory or migrate the old one; never open it with this code."""


class AuditRecordError(StorageError):
    """An audit record could not be decoded (bad JSON, missing or unknown field). Treat the log as
    tampered: run `verify()` and report the first break."""
