"""Errors raised by kernels/."""


class KernelError(Exception):
    """A kernel could not run (backend unavailable, device mismatch). Fall back to backend="torch"."""
