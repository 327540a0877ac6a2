"""Versioned .proto files (package kvresume.v1) and `proto.generate`, the generator of their modules.

The generated modules are committed in the light client package `kvresume/v1/`; regenerate them after
a .proto change with `python -m proto.generate` (`tests/orchestrator/api/test_stubs.py` fails while
they differ from what the pinned generator makes).
"""

__all__: list[str] = []
