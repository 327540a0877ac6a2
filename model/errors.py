"""Errors raised by model/."""


class ModelError(Exception):
    """Base class of model errors; subclasses say what the caller should do."""


class CheckpointMismatch(ModelError):
    """A checkpoint's tensors do not match what the model expects: missing, unexpected, or of another
    shape or dtype. The message names every offending tensor. Load a checkpoint written for this config
    (or convert it); nothing was loaded into the model.
    """

    def __init__(
        self,
        *,
        missing: list[str],
        unexpected: list[str],
        mismatched: list[str],
        source: str,
    ) -> None:
        self.missing = missing
        self.unexpected = unexpected
        self.mismatched = mismatched
        parts = []
        if missing:
            parts.append(f"missing {len(missing)}: {', '.join(missing)}")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)}: {', '.join(unexpected)}")
        if mismatched:
            parts.append(f"mismatched {len(mismatched)}: {'; '.join(mismatched)}")
        super().__init__(f"checkpoint {source} does not match the model: " + " | ".join(parts))


class UnsupportedConfigError(ModelError, ValueError):
    """The config enables a feature this model does not implement (Engram, MTP/DSpark, vision).

    Disable it in the config; byte accounting (`kv_bytes`) still works on such a config.
    """



class CacheFormatError(ModelError, ValueError):
    """A cache blob cannot be imported: truncated, corrupted (checksum), another format version, another
    model fingerprint, or positions that do not continue the state. Treat it as a cache miss.
    """
