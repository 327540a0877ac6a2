"""The Mappers service: register (admin token), list and get (any token). Fitting jobs come later."""

from __future__ import annotations

from typing import Any

import grpc

from orchestrator.api.context import ServiceContext
from orchestrator.api.errors import InvalidRequestError, NotFoundError
from orchestrator.api.status_table import unary_errors
from orchestrator.db import MapperRepository, run_serializable

__all__ = ["MappersServicer", "servicer_class"]


def servicer_class(ctx: ServiceContext) -> type:
    return type("MappersServicer", (MappersServicer, ctx.stubs.mappers_grpc.MappersServicer), {})


class MappersServicer:
    def __init__(self, ctx: ServiceContext) -> None:
        self._ctx = ctx
        self._pb = ctx.stubs.mappers

    @unary_errors
    def RegisterMapper(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._ctx.auth.admin(context)
        if not request.HasField("mapper"):
            raise InvalidRequestError("mapper is required")
        registration = self._ctx.convert.mapper_registration(request.mapper)

        def work(s: Any) -> Any:
            return self._ctx.convert.mapper(MapperRepository(s).register(registration))

        return run_serializable(self._ctx.serializable, work)

    @unary_errors
    def ListMappers(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._ctx.auth.any(context)
        with self._ctx.sessions() as s:
            rows = MapperRepository(s).list(
                sender_model=request.sender_model or None, receiver_model=request.receiver_model or None
            )
            return self._pb.ListMappersResponse(mappers=[self._ctx.convert.mapper(r) for r in rows])

    @unary_errors
    def GetMapper(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._ctx.auth.any(context)
        if not request.mapper_id:
            raise InvalidRequestError("mapper_id is required")
        with self._ctx.sessions() as s:
            row = MapperRepository(s).get(request.mapper_id)
            if row is None:
                raise NotFoundError(f"mapper {request.mapper_id} not found", reason="MAPPER_NOT_FOUND")
            return self._ctx.convert.mapper(row)
