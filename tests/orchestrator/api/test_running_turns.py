"""The running turns' registry (orchestrator/api/running_turns.py): a handle says when its turn has left it,
which the gRPC servicer's end-of-call callback reads before cancelling (a finished turn has nothing to
stop)."""

from __future__ import annotations

import pytest

from orchestrator.api.errors import PreconditionError
from orchestrator.api.running_turns import RunningTurns


def test_a_turn_is_finished_once_it_leaves_the_running_turns() -> None:
    turns = RunningTurns()
    handle = turns.start("s1", "r1", "t")
    assert not handle.finished and turns.running("s1")
    with pytest.raises(PreconditionError):
        turns.start("s1", "r2", "t")
    turns.finish(handle)
    assert handle.finished and not turns.running("s1") and len(turns) == 0
    # a cancel after the end changes nothing a turn reads (the servicer skips it)
    handle.cancel("client cancelled")
    again = turns.start("s1", "r1", "t")
    assert not again.finished and not again.cancelled
