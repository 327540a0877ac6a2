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


class StoreDamagedError(StorageError):
    """The database cannot be read whole: RocksDB reports corruption or an I/O error, a file it needs
    (MANIFEST, CURRENT, an SST) is damaged, or one of the store's own entries does not decode. The
    store is a cache of data SQL holds authoritatively: quarantine the directory (`open_store` does,
    `kvresume admin store repair` offline) and start empty; never delete entries of it in place."""


class StoreVersionError(StoreFormatError):
    """The directory holds a store of a newer on-disk format than this code knows. Run the newer
    version (or point this one at another directory); it is neither opened nor quarantined, so a
    downgrade never wipes a newer store."""


class StoreLockedError(StorageError):
    """Another store object or process holds the database open (RocksDB's LOCK file). Stop it first;
    a locked store is never treated as damaged, so it is neither quarantined nor touched."""
