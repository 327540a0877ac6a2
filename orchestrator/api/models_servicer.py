"""The Models service: which models this node serves, their limits and fingerprints, and their tokenizer.

Any valid token (a tenant's or the admin's) may call it; it reveals nothing of sessions.
"""

from __future__ import annotations

from typing import Any

import grpc

from orchestrator.api.context import ServiceContext
from orchestrator.api.errors import (
    InvalidRequestError,
    ResourceExhaustedError,
    check_name_length,
    model_not_served,
)
from orchestrator.api.model_catalog import ModelCatalog, ModelDescription
from orchestrator.api.status_table import unary_errors

__all__ = ["ModelsServicer", "servicer_class"]



def servicer_class(ctx: ServiceContext) -> type:
    """The servicer class, derived from the generated base so unimplemented methods say UNIMPLEMENTED."""
    base = ctx.stubs.models_grpc.ModelsServicer
    return type("ModelsServicer", (ModelsServicer, base), {})


class ModelsServicer:
    def __init__(self, ctx: ServiceContext) -> None:
        self._ctx = ctx
        self._pb = ctx.stubs.models

    def _catalog(self) -> ModelCatalog:
        catalog = self._ctx.model_catalog
        if catalog is None:
            raise NotImplementedError("this server has no served models configured")
        return catalog

    def _described(self, name: str) -> ModelDescription:
        if not name:
            raise InvalidRequestError("model name is required", field="name")
        check_name_length("name", name)
        catalog = self._catalog()
        described = catalog.describe(name)
        if described is None:
            raise model_not_served(name, catalog.names)
        return described

    def _info(self, d: ModelDescription) -> Any:
        settings = self._ctx.settings
        return self._pb.ModelInfo(
            name=d.name,
            fingerprint=d.fingerprint,
            numerics_profile=d.numerics_profile,
            vocab_size=d.vocab_size,
            window=d.window,
            chunk_tokens=settings.kv_chunk_tokens,
            max_context_tokens=d.max_context_tokens,
            max_turn_tokens=settings.max_turn_tokens,
            max_new_tokens=settings.max_new_tokens,
            kv_bytes_per_token=d.kv_bytes_per_token,
            tokenizer=d.tokenizer,
            source=d.source,
            config_name=d.config_name,
        )

    @unary_errors
    def ListModels(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._ctx.auth.any(context)
        catalog = self._catalog()
        infos = [self._info(d) for n in catalog.names if (d := catalog.describe(n)) is not None]
        return self._pb.ListModelsResponse(models=infos)

    @unary_errors
    def GetModel(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._ctx.auth.any(context)
        return self._info(self._described(request.name))

    @unary_errors
    def Tokenize(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._ctx.auth.any(context)
        described = self._described(request.model)
        limit = self._ctx.settings.max_turn_tokens * 4
        if len(request.text.encode()) > limit:
            raise ResourceExhaustedError(
                f"text of {len(request.text.encode())} bytes exceeds the limit {limit}",
                reason="REQUEST_TOO_LARGE",
                field="text",
            )
        ids = self._catalog().tokenize(described.name, request.text)
        return self._pb.TokenizeResponse(ids=ids, count=len(ids))

    @unary_errors
    def Detokenize(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._ctx.auth.any(context)
        described = self._described(request.model)
        if len(request.ids) > self._ctx.settings.max_turn_tokens:
            raise ResourceExhaustedError(
                f"{len(request.ids)} ids exceed the limit {self._ctx.settings.max_turn_tokens}",
                reason="REQUEST_TOO_LARGE",
                field="ids",
            )
        bad = [i for i in request.ids if i >= described.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"token id {bad[0]} is outside the vocabulary of {described.name} "
                f"(size {described.vocab_size})",
                reason="TOKEN_OUT_OF_VOCABULARY",
                field="ids",
            )
        return self._pb.DetokenizeResponse(text=self._catalog().detokenize(described.name, list(request.ids)))
