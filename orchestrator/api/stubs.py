"""The protobuf/gRPC modules of proto/kvresume/v1, as the servicers see them.

The modules are generated once and committed in the light client package `kvresume/v1/` (a client needs
only grpcio and protobuf, no build step); `python -m proto.generate` regenerates them.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

__all__ = ["Stubs", "load_stubs"]


@dataclass(frozen=True, kw_only=True)
class Stubs:
    """The generated modules: messages (`*_pb2`) and services (`*_pb2_grpc`)."""

    common: ModuleType
    sessions: ModuleType
    sessions_grpc: ModuleType
    admin: ModuleType
    admin_grpc: ModuleType
    mappers: ModuleType
    mappers_grpc: ModuleType
    models: ModuleType
    models_grpc: ModuleType

    @property
    def service_names(self) -> tuple[str, ...]:
        """Full names of our services, for reflection and health."""
        return tuple(
            module.DESCRIPTOR.services_by_name[name].full_name
            for module, name in (
                (self.sessions, "Sessions"),
                (self.admin, "Admin"),
                (self.mappers, "Mappers"),
                (self.models, "Models"),
            )
        )


def load_stubs() -> Stubs:
    """The committed modules (imported once; cheap after the first call)."""
    from kvresume.v1 import (
        admin_pb2,
        admin_pb2_grpc,
        common_pb2,
        mappers_pb2,
        mappers_pb2_grpc,
        models_pb2,
        models_pb2_grpc,
        sessions_pb2,
        sessions_pb2_grpc,
    )

    return Stubs(
        common=common_pb2,
        sessions=sessions_pb2,
        sessions_grpc=sessions_pb2_grpc,
        admin=admin_pb2,
        admin_grpc=admin_pb2_grpc,
        mappers=mappers_pb2,
        mappers_grpc=mappers_pb2_grpc,
        models=models_pb2,
        models_grpc=models_pb2_grpc,
    )
