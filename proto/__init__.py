"""Versioned .proto files (package kvresume.v1). Generated stubs are build output, never committed."""

__all__: list[str] = []
