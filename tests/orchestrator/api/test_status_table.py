"""The error table maps each error class to its one status code; unknown errors become INTERNAL."""

from __future__ import annotations

import grpc
import pytest

from orchestrator.api import errors
from orchestrator.api.status_table import STATUS_TABLE, status_for
from orchestrator.model_process import ModelProcessError
from storage import StoreDamagedError


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (errors.InvalidRequestError("token id 99999 out of vocabulary"), grpc.StatusCode.INVALID_ARGUMENT),
        (ValueError("bad"), grpc.StatusCode.INVALID_ARGUMENT),
        (errors.NotFoundError("x"), grpc.StatusCode.NOT_FOUND),
        (errors.PermissionDeniedError("x"), grpc.StatusCode.PERMISSION_DENIED),
        (errors.UnauthenticatedError("x"), grpc.StatusCode.UNAUTHENTICATED),
        (errors.PreconditionError("x"), grpc.StatusCode.FAILED_PRECONDITION),
        (errors.ResourceExhaustedError("x"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (errors.UnavailableError("x"), grpc.StatusCode.UNAVAILABLE),
        (StoreDamagedError("x"), grpc.StatusCode.UNAVAILABLE),
        (ModelProcessError("the model process ended"), grpc.StatusCode.UNAVAILABLE),
        (errors.DeadlineError("x"), grpc.StatusCode.DEADLINE_EXCEEDED),
        (errors.CancelledError("x"), grpc.StatusCode.CANCELLED),
        (NotImplementedError("x"), grpc.StatusCode.UNIMPLEMENTED),
        (KeyError("leaky internals"), grpc.StatusCode.INTERNAL),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else v.name,
)
def test_status_for_maps_each_error_once(exc: BaseException, code: grpc.StatusCode) -> None:
    got, message = status_for(exc)
    assert got == code
    assert message == ("internal error" if code == grpc.StatusCode.INTERNAL else str(exc))


def test_status_table_orders_subclasses_before_bases() -> None:
    classes = [cls for cls, _, _ in STATUS_TABLE]
    for i, cls in enumerate(classes):
        for later in classes[i + 1 :]:
            assert not issubclass(later, cls), f"{later.__name__} is shadowed by {cls.__name__}"
