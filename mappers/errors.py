"""Errors raised by mappers/."""


class MapperError(Exception):
    """Base class of mapper errors; subclasses say what the caller should do."""


class MapperMismatch(MapperError):
    """The mapper was built for another sender or receiver model (fingerprint or name differs).

    The caller should check `applicability` first and fall back to a cold prefill on the receiver.
    """


class FitError(MapperError):
    """A fit could not produce a finite map (too few rows, non-finite captures).

    The caller should calibrate on more tokens or raise the ridge alpha; the pair has no usable mapper.
    """
