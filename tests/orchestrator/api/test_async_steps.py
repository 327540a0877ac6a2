"""AsyncSteps: a turn's steps driven from an event loop, its stretches on a worker pool and its pass waits
awaited on the loop, against the same steps driven inline (`wait_inline`)."""

from __future__ import annotations

import asyncio
import contextvars
import random
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from orchestrator.api.async_steps import END, AsyncSteps
from orchestrator.scheduler import await_pass, wait_inline

_FIELD: contextvars.ContextVar[str] = contextvars.ContextVar("field", default="unset")


class _Steps:
    """Steps that emit events and wait for passes, recording the threads and context they ran in."""

    def __init__(self, script: list[str], passes: dict[int, Future]) -> None:
        self.script, self.passes = script, passes
        self.threads: set[str] = set()
        self.fields: list[str] = []
        self.closed = threading.Event()
        self.finished = False

    def __iter__(self):
        try:
            _FIELD.set("bound-by-the-steps")
            for i, name in enumerate(self.script):
                self.threads.add(threading.current_thread().name)
                if i in self.passes:
                    result = yield from await_pass(self.passes[i])
                    name = f"{name}:{result}"
                self.fields.append(_FIELD.get())
                yield name
            self.finished = True
        finally:
            self.closed.set()


async def _collect(steps, executor) -> list[object]:
    driven = AsyncSteps(steps, executor)
    out = []
    try:
        while (item := await driven.next()) is not END:
            out.append(item)
    finally:
        await driven.close()
    return out


def _drive(steps, executor) -> list[object]:
    return asyncio.run(_collect(steps, executor))


def _later(result: object, delay_s: float) -> Future:
    future: Future = Future()
    threading.Timer(delay_s, future.set_result, args=(result,)).start()
    return future


def test_events_equal_the_inline_drive_and_stretches_run_on_the_pool_in_one_context() -> None:
    rng = random.Random()
    script = [f"e{i}" for i in range(rng.randrange(3, 9))]
    waits = set(rng.sample(range(len(script)), k=len(script) // 2))

    def passes() -> dict[int, Future]:
        return {i: _later(i * 10, 0.01) for i in waits}

    inline = _Steps(script, passes())
    expected = contextvars.copy_context().run(lambda: list(wait_inline(iter(inline))))
    with ThreadPoolExecutor(2, thread_name_prefix="pool") as executor:
        steps = _Steps(script, passes())
        assert _drive(iter(steps), executor) == expected
    assert steps.finished and steps.closed.is_set()
    assert all(name.startswith("pool") for name in steps.threads)
    # what the steps bound in their context stays bound from stretch to stretch, whichever thread runs them
    assert steps.fields == ["bound-by-the-steps"] * len(script)
    assert _FIELD.get() == "unset"


def test_turns_waiting_for_passes_hold_no_thread() -> None:
    """Four turns whose passes finish only once all four wait for them, on a pool of one thread: were a
    thread held per waiting turn, the first would hold the only one and the others would never start."""
    arrived = threading.Semaphore(0)
    passes = [Future() for _ in range(4)]

    def steps(i: int):
        yield "before"
        arrived.release()
        result = yield from await_pass(passes[i])
        yield f"after:{result}"

    def release() -> None:
        if all(arrived.acquire(timeout=30) for _ in range(4)):
            for i, future in enumerate(passes):
                future.set_result(i)
        else:
            for future in passes:
                future.set_exception(TimeoutError("not every turn reached its pass"))

    async def main() -> list[list[object]]:
        return await asyncio.gather(*(_collect(steps(i), executor) for i in range(4)))

    releaser = threading.Thread(target=release)
    releaser.start()
    with ThreadPoolExecutor(1) as executor:
        got = asyncio.run(main())
    releaser.join(5)
    assert got == [["before", f"after:{i}"] for i in range(4)]


@pytest.mark.parametrize("where", ["stretch", "pass"])
def test_a_cancel_waits_out_what_is_in_flight_then_closes_the_steps(where: str) -> None:
    """A cancel while a stretch runs (or a pass is awaited) leaves it to finish, never cancels the pass's
    future, then closes the steps (GeneratorExit) on a worker; the close must not enter the steps' context
    while the stretch still holds it."""
    in_flight = threading.Event()
    release = threading.Event()
    pass_future: Future = Future()
    seen: list[str] = []

    def steps():
        try:
            yield "first"
            if where == "stretch":
                in_flight.set()
                release.wait(30)
                seen.append("stretch ended")
            else:
                in_flight.set()
                yield from await_pass(pass_future)
            yield "never read"
        except GeneratorExit:
            seen.append("closed")
            raise

    async def main() -> None:
        driven = AsyncSteps(steps(), executor)
        assert await driven.next() == "first"
        task = asyncio.ensure_future(driven.next())
        while not in_flight.is_set():
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        closing = asyncio.ensure_future(driven.close())
        await asyncio.sleep(0.05)
        assert not closing.done()  # still waiting for the stretch or pass in flight
        if where == "stretch":
            release.set()
        else:
            assert not pass_future.cancelled()
            pass_future.set_result("late")
        await asyncio.wait_for(closing, 30)
        await driven.close()  # again: nothing left to do

    with ThreadPoolExecutor(2) as executor:
        asyncio.run(main())
    assert seen == (["stretch ended", "closed"] if where == "stretch" else ["closed"])


def test_an_error_of_the_steps_reaches_the_caller_and_close_is_then_a_no_op() -> None:
    def steps():
        yield "first"
        raise ValueError("bad step 7")

    async def main() -> None:
        driven = AsyncSteps(steps(), executor)
        assert await driven.next() == "first"
        with pytest.raises(ValueError, match="bad step 7"):
            await driven.next()
        await driven.close()
        assert await driven.next() is END

    with ThreadPoolExecutor(1) as executor:
        asyncio.run(main())


def test_a_failed_pass_raises_inside_the_steps_where_they_wait() -> None:
    caught: list[str] = []

    def steps():
        pending: Future = Future()
        threading.Timer(0.01, lambda: pending.set_exception(RuntimeError("the model process died"))).start()
        try:
            yield from await_pass(pending)
        except RuntimeError as exc:
            caught.append(str(exc))
        yield "after"

    with ThreadPoolExecutor(1) as executor:
        assert _drive(steps(), executor) == ["after"]
    assert caught == ["the model process died"]
