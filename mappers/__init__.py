"""Cross-model KV mappers: fit, evaluate and apply closed-form ridge maps between sibling models."""

from mappers.errors import MapperError

__all__ = ["MapperError"]
