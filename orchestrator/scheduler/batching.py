"""The batching scheduler: one step loop per served model that runs the work of many sessions together,
as continuous-batching engines do (vLLM v1's scheduler beside its model runner, SGLang's).

Each step takes every waiting decode token (up to `max_batch_sequences`, in fair order) into one
batch-invariant `decode_many` pass, plus prefill or replay chunks in fair order until the step's token
budget is used, run together in one batch-invariant `prefill_many` pass (chunked prefill interleaved with
decode: a long prompt costs everyone one bounded chunk per step, not its whole length); chunks that come
in while the loop's decode pass runs join the prefill pass under what is left of the budget. A turn's
decodes form a chain (chains.py): the step samples each token as its pass ends and queues the token's
decode itself, so the next step has it without waiting for the turn. Turns wait on a future per pass
(in their own threads, or on the asyncio server's loop without a thread: the turn engine yields a
`PassWait`). One step runs at a time: the loop thread's, or, when the loop is
idle and nothing waits, the asking turn's own (the step the loop would have run: that request alone,
without the two thread handoffs). Cancellation, deadlines and disconnects are checked by the turn
between passes, so they take effect at the next step, and a step is bounded by the budget.

Exactness: `decode_many` / `prefill_many` equal each sequence's lone `decode` / `prefill` bit for bit and
chunked prefill equals one-shot prefill, so what a session gets does not depend on who shares its steps
(tests compare a session alone and among others).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any

import structlog

from orchestrator.scheduler.admission import Admission
from orchestrator.scheduler.chains import DecodeChain, continue_chain
from orchestrator.scheduler.fair_order import FairOrder
from orchestrator.scheduler.work import NullObserver, PassRequest, SchedulerObserver, StepCompute, WorkOwner

__all__ = ["DEFAULT_STEP_TOKEN_BUDGET", "BatchingScheduler"]

# Prompt rows a step takes by default (and the prefill chunk size): orchestrator/README.md, "Many sessions
# at once", measures 512 against 256; the `step_token_budget` setting defaults to the same.
DEFAULT_STEP_TOKEN_BUDGET = 512

log = structlog.get_logger(__name__)

# How long the loop holds the next step for the turns whose pass just ended and that said they would ask
# again at once (`PassRequest.follow_up`): a fraction of the last step's wall time, and at most a cap.
# Why: a step runs its decode pass, then its prefill pass, and the next step starts the moment it ends;
# a turn whose prompt chunk was in the prefill pass samples its first token and asks for its decode a
# few milliseconds later, by which time the next step has started without it, so every turn waited a
# whole step after its prompt (measured: about 7.3 steps per turn of one prompt and four decodes).
# Decodes answered mid-step re-ask while the prefill pass runs and need no wait.
FOLLOW_UP_WAIT_FRACTION = 0.1
FOLLOW_UP_WAIT_MAX_S = 0.02


def _under_budget(ranked: list[PassRequest], budget: int, *, first_free: bool) -> list[PassRequest]:
    """The prefill chunks of `ranked` (in its order) whose rows fit `budget`; with `first_free`, the first
    chunk whatever its size (at least one chunk per step, so a budget smaller than a chunk cannot stall
    prefills)."""
    picked: list[PassRequest] = []
    for r in ranked:
        if r.is_decode:
            continue
        if r.rows > budget and (picked or not first_free):
            break
        picked.append(r)
        budget -= r.rows
    return picked


class _ModelLoop:
    """The step loop of one served model: a queue of pass requests and the thread that runs them."""

    def __init__(self, scheduler: BatchingScheduler, model: str) -> None:
        self._s = scheduler
        self.model = model
        self._cond = threading.Condition()
        self._waiting: list[PassRequest] = []
        self._order = FairOrder()
        self._step = 0
        self._closed = False
        # a step is running (the loop's, or one inline in the asking turn's thread)
        self._busy = False
        # the turns of the last step that will ask again at once, and until when the next step waits
        self._expected: set[WorkOwner] = set()  # (frozen: equal per tenant and session)
        self._expect_until = 0.0
        # the running step: whether its chains queue their next decodes, and the turns whose chain wants
        # a decode it left to them to submit (`_run_step`)
        self._chains_queue = True
        self._deferred: set[WorkOwner] = set()
        # the last step's prompt results, held until this step's decode pass is sent (`_publish_held`),
        # and where `_resolve` puts them while the step holds them (None: it sets futures at once)
        self._held: list[tuple[PassRequest, Any, BaseException | None]] = []
        self._holding: list[tuple[PassRequest, Any, BaseException | None]] | None = None
        self._thread = threading.Thread(target=self._run, name=f"kvresume-step-{model}", daemon=True)
        self._thread.start()

    def submit(self, request: PassRequest) -> Future:
        """Queue the request (or run it now, below); its future holds the pass's result or error."""
        with self._cond:
            if self._closed:
                raise RuntimeError(f"the scheduler of model {self.model} is closed")
            # Idle and nobody waiting: the step the loop would take is this request alone, so this thread
            # runs it (same pass, same fair-order and step bookkeeping) instead of waking the loop and
            # being woken again: on a loaded machine each of the two wake-ups can cost milliseconds.
            # (not while the loop holds the step for other turns' follow-ups: this one joins them)
            inline = not self._busy and not self._waiting and not (self._expected - {request.owner})
            if inline:
                self._expected = set()
                self._busy = True
                self._step += 1
                self._order.served([request], self._step)
            else:
                self._waiting.append(request)
                self._cond.notify()
        if inline:
            alone = [request]
            try:
                self._run_step(alone if request.is_decode else [], [] if request.is_decode else alone,
                               in_loop=False)  # fmt: skip
            finally:
                with self._cond:
                    self._busy = False
                    if self._waiting or self._closed:
                        self._cond.notify_all()
        return request.future

    def waiting(self) -> int:
        with self._cond:
            return len(self._waiting)

    def forget(self, owner: WorkOwner) -> None:
        """Drop a finished turn's session from the fair order (its memory stays bounded by live turns)."""
        with self._cond:
            self._order.forget(owner.tenant_id, owner.session_id)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=10)

    def _take(self) -> tuple[list[PassRequest], list[PassRequest]] | None:
        """Wait for work; the decodes and prefill chunks of the next step, in fair order."""
        with self._cond:
            while (self._busy or not self._waiting) and not self._closed:
                self._cond.wait()
            while self._busy:  # closing while an inline step runs: its end notifies
                self._cond.wait()
            if self._closed and not self._waiting:
                return None
            self._await_follow_ups()
            self._busy = True
            ranked = self._order.rank(self._waiting)
            decodes = [r for r in ranked if r.is_decode][: self._s.max_batch_sequences]
            prefills = _under_budget(ranked, self._s.step_token_budget - len(decodes), first_free=True)
            self._step += 1
            self._taken(decodes + prefills)
            return decodes, prefills

    def _taken(self, requests: list[PassRequest]) -> None:
        """Take `requests` out of the queue into the current step (the condition held)."""
        taken = set(map(id, requests))
        self._waiting = [r for r in self._waiting if id(r) not in taken]
        self._order.served(requests, self._step)

    def _late_prefills(self, budget: int, first_free: bool) -> list[PassRequest]:
        """The prefill chunks that arrived while the step's decode pass ran, in fair order, under what is
        left of the step's budget: they join this step's prefill pass instead of waiting for the next
        step (a turn's prompt that comes in during a decode pass saves a whole step)."""
        with self._cond:
            waiting = [r for r in self._waiting if not r.is_decode]
            if not waiting:
                return []
            late = _under_budget(self._order.rank(waiting), budget, first_free=first_free)
            self._taken(late)
            return late

    def _await_follow_ups(self) -> None:
        """Hold the next step (the condition held) until every turn of the last step that said it would
        ask again has asked, or the wait's deadline passed, or the loop closes."""
        while self._expected and not self._closed:
            self._expected -= {r.owner for r in self._waiting}
            left = self._expect_until - time.perf_counter()
            if not self._expected or left <= 0:
                break
            self._cond.wait(left)
        self._expected = set()

    def _run(self) -> None:
        try:
            while True:
                if self._held and not self._next_step_ready():
                    self._publish_held()
                work = self._take()
                if work is None:
                    return
                try:
                    self._run_step(*work, in_loop=True)
                finally:
                    with self._cond:
                        self._busy = False
        finally:
            self._publish_held()

    def _next_step_ready(self) -> bool:
        """Whether `_take` would start the next step at once (work waits, and no turn is waited for)."""
        with self._cond:
            return bool(self._waiting) and not self._expected and not self._closed

    def _publish_held(self) -> None:
        """Set the futures of the last step's prompt chunks (`_run_step` holds them until the next decode
        pass is sent, or until the loop would wait)."""
        with self._cond:  # (a step run inline in a turn's thread may publish them too)
            held, self._held = self._held, []
        for r, value, exc in held:
            if exc is not None:
                r.future.set_exception(exc)
            else:
                r.future.set_result(value)

    def _run_step(self, decodes: list[PassRequest], prefills: list[PassRequest], *, in_loop: bool) -> None:
        """Run one step's passes (each request's future gets its result or its error) and report it.

        in_loop: the loop thread's step. Prompt chunks that came in during its decode pass join its
        prefill pass, and its decode chains queue their next decodes. A step run inline in the asking
        turn's thread (`submit`: the loop was idle) does neither: it returns to that turn, whose token
        would otherwise wait for others' prompts, and whose next decode, submitted by the turn after it
        streamed the token, runs inline again while the loop stays idle (queued, it would cost two
        thread handoffs a token: measured, one no-op session's turn 4.8 -> 6.5 ms).
        """
        started, cpu_started = time.perf_counter(), time.thread_time()
        self._chains_queue = in_loop
        self._deferred = set()
        obs = self._s.observer
        for r in decodes + prefills:
            obs.waited(self.model, "decode" if r.is_decode else "prefill", started - r.enqueued_at)
        if decodes:
            decoded = self._decode(decodes)
        else:
            decoded = []
            self._publish_held()
        if decodes and in_loop:
            left = self._s.step_token_budget - len(decodes) - sum(r.rows for r in prefills)
            late = self._late_prefills(left, first_free=not prefills)
            if late:
                now = time.perf_counter()
                for r in late:
                    obs.waited(self.model, "prefill", now - r.enqueued_at)
                prefills = prefills + late
        # The prefill pass goes out before the decode pass's chains are sampled, where the compute can
        # send a pass and wait for it apart (a model process): it computes meanwhile instead of idling.
        prefilled = self._start_prefill(prefills) if prefills else None
        self._resolve(decoded)
        if prefilled is not None:
            # The prompts' results wait until the next step's decode pass is sent, where passes are sent
            # apart (a model process): their turns' threads wake to stream a token and contend for the
            # GIL with this thread, which meanwhile samples their chains and starts the next step.
            self._holding = [] if in_loop and self._sends_apart() else None
            try:
                prefilled()
            finally:
                if self._holding is not None:
                    with self._cond:
                        self._held.extend(self._holding)
                    self._holding = None
        tokens = len(decodes) + sum(r.rows for r in prefills)
        ended = time.perf_counter()
        with self._cond:
            # (a chain that wants a decode it did not queue: its turn asks for it at once)
            self._expected = {r.owner for r in decodes + prefills if r.follow_up} | self._deferred
            wait = min(FOLLOW_UP_WAIT_MAX_S, FOLLOW_UP_WAIT_FRACTION * (ended - started))
            self._expect_until = ended + wait
        obs.step(self.model, sequences=len(decodes), tokens=tokens, seconds=time.perf_counter() - started,
                 cpu_seconds=time.thread_time() - cpu_started)  # fmt: skip
        obs.gauges(self.model, running=self._s.running(self.model), waiting=self.waiting())

    def _start_prefill(self, prefills: list[PassRequest]) -> Callable[[], None]:
        """Send the step's prefill pass when the compute can send one and wait for it apart
        (`start_prefill_many`); the function that completes it (waits, resolves the requests, or runs
        the pass now: `_prefill`)."""
        start = getattr(self._s.compute, "start_prefill_many", None)
        if start is None or len(prefills) < 2:
            return lambda: self._prefill(prefills)
        args = ([r.tokens for r in prefills], [r.state for r in prefills], [r.prompt_end for r in prefills])
        try:
            finish = start(prefills[0].served, *args, logits=[r.logits_wanted for r in prefills])
        except BaseException as exc:  # noqa: BLE001 - isolate the failing chunk: `_prefill`'s fallback
            return lambda error=exc: self._prefill(prefills, batched_error=error)
        return lambda: self._prefill(prefills, outputs=finish)

    def _prefill(
        self,
        prefills: list[PassRequest],
        *,
        outputs: Callable[[], list[Any]] | None = None,
        batched_error: BaseException | None = None,
    ) -> None:
        """The step's prefill chunks in one `prefill_many` pass when the compute has one (bit-identical to
        one `prefill` each); one at a time otherwise, or when the batched pass fails. `outputs`: the
        pass's outputs, when it was sent already; `batched_error`: it failed as it was sent."""
        many = getattr(self._s.compute, "prefill_many", None)
        if batched_error is None and len(prefills) > 1 and (outputs is not None or many is not None):
            try:
                if outputs is not None:
                    outs = outputs()
                else:
                    outs = many(prefills[0].served, [r.tokens for r in prefills], [r.state for r in prefills],
                                [r.prompt_end for r in prefills])  # fmt: skip
            except BaseException as exc:  # noqa: BLE001 - isolate the failing chunk, below
                batched_error = exc
            else:
                self._resolve(list(zip(prefills, outs, strict=True)))
                return
        if batched_error is not None:
            # prefill_many validates before it touches any state, so no state was half-updated
            log.warning(
                "batched_prefill_failed", model=self.model, sequences=len(prefills), error=str(batched_error)
            )
        for r in prefills:
            try:
                out = self._s.compute.prefill(r.served, r.tokens, r.state, prompt_end=r.prompt_end)
            except BaseException as exc:  # noqa: BLE001 - the turn that asked gets its own error
                r.future.set_exception(exc)
            else:
                self._resolve([(r, out)])

    def _sends_apart(self) -> bool:
        return getattr(self._s.compute, "start_decode_many", None) is not None

    def _decode(self, decodes: list[PassRequest]) -> list[tuple[PassRequest, Any]]:
        """The step's decode pass; the requests that got an output, with it, for `_resolve` (the others
        got their error here). The last step's held prompt results go out as soon as the pass is sent."""
        served = decodes[0].served
        tokens, states = [r.token for r in decodes], [r.state for r in decodes]
        start = getattr(self._s.compute, "start_decode_many", None)
        try:
            if start is not None:
                # (a compute that sends passes apart sends only the logits the chains read: work.py)
                finish = start(served, tokens, states, logits=[r.logits_wanted for r in decodes])
                self._publish_held()
                outs = finish()
            else:
                self._publish_held()
                outs = self._s.compute.decode_many(served, tokens, states)
        except BaseException as exc:  # noqa: BLE001 - isolate the failing sequence, below
            self._publish_held()
            if len(decodes) == 1:
                decodes[0].future.set_exception(exc)
                return []
            # One sequence's failure must not fail the others: run each alone (bit-identical anyway).
            # decode_many validates before it touches any state, so no state was half-updated.
            log.warning("batched_decode_failed", model=self.model, sequences=len(decodes), error=str(exc))
            done = []
            for r in decodes:
                try:
                    done.append((r, self._s.compute.decode(r.served, r.token, r.state)))
                except BaseException as one:  # noqa: BLE001 - the turn that asked gets its own error
                    r.future.set_exception(one)
            return done
        return list(zip(decodes, outs, strict=True))

    def _resolve(self, done: list[tuple[PassRequest, Any]]) -> None:
        """Give each request its pass's output; for a decode chain's pass, sample the turn's next token
        first and, in the loop's steps, queue its decode (chains.py), so that the next step takes it
        without waiting for the turn. Every chain is continued before any future is set: a set future
        wakes its turn's thread, which then contends for the GIL with this one at every op that lets go
        of it (measured with the futures set one by one as each chain went on: 18 ms between a step's
        two passes, against 1)."""
        results: list[tuple[PassRequest, Any, BaseException | None]] = []
        for r, out in done:
            if r.chain is None:
                results.append((r, out, None))
                continue
            queue = (lambda token, then, r=r, out=out: self._queue_next(r, out, token, then)
                     ) if self._chains_queue else None  # fmt: skip
            try:
                go_on = continue_chain(r.chain, out, queue)
            except BaseException as exc:  # noqa: BLE001 - a sampler's failure is the turn's own error
                results.append((r, None, exc))
            else:
                results.append((r, go_on, None))
                if go_on.decode and go_on.next is None:
                    self._deferred.add(r.owner)
        if self._holding is not None:
            self._holding.extend(results)
            return
        for r, value, exc in results:
            if exc is not None:
                r.future.set_exception(exc)
            else:
                r.future.set_result(value)

    def _queue_next(self, r: PassRequest, out: Any, token: int, then: DecodeChain | None) -> Future:
        """Queue the decode of `token` on the pass's state (a chain's next pass); its future."""
        request = self._s._request(r.owner, r.served, out.state, token=token, chain=then)
        with self._cond:
            if self._closed:
                raise RuntimeError(f"the scheduler of model {self.model} is closed")
            self._waiting.append(request)
            self._cond.notify()
        return request.future


class BatchingScheduler:
    """One `_ModelLoop` per served model, started on the model's first pass.

    Args:
        compute: runs the passes (`decode_many` for the batched step).
        max_batch_sequences: most sequences decoded in one step.
        step_token_budget: prompt rows (plus decode rows) per step; also the prefill chunk size the turn
            engine uses (`chunk_tokens`), so one chunk always fits a step.
        max_running_turns: admission bound per model.
        observer: where steps are reported (metrics).
    """

    name = "batching"

    def __init__(
        self,
        compute: StepCompute,
        *,
        max_batch_sequences: int = 64,
        step_token_budget: int = DEFAULT_STEP_TOKEN_BUDGET,
        max_running_turns: int = 96,
        observer: SchedulerObserver | None = None,
    ) -> None:
        if max_batch_sequences <= 0 or step_token_budget <= 0:
            raise ValueError(
                f"max_batch_sequences={max_batch_sequences} and step_token_budget={step_token_budget} "
                "must be positive"
            )
        self.compute = compute
        self.max_batch_sequences = max_batch_sequences
        self.step_token_budget = step_token_budget
        self.chunk_tokens: int | None = step_token_budget
        self.observer = observer if observer is not None else NullObserver()
        self._admission = Admission(max_running_turns)
        self._loops: dict[str, _ModelLoop] = {}
        self._lock = threading.Lock()
        self._seq = 0

    @contextmanager
    def admit(self, model: str, owner: WorkOwner) -> Iterator[None]:
        with self._admission.admit(model):
            try:
                yield
            finally:
                with self._lock:
                    loop = self._loops.get(model)
                if loop is not None:
                    loop.forget(owner)

    def running(self, model: str) -> int:
        return self._admission.running(model)

    def waiting(self, model: str) -> int:
        """Pass requests queued for the model's next step (0 before its first pass)."""
        with self._lock:
            loop = self._loops.get(model)
        return loop.waiting() if loop is not None else 0

    def _loop(self, model: str) -> _ModelLoop:
        with self._lock:
            loop = self._loops.get(model)
            if loop is None:
                loop = self._loops[model] = _ModelLoop(self, model)
            return loop

    def _request(self, owner: WorkOwner, served: Any, state: Any, **work: Any) -> PassRequest:
        with self._lock:
            self._seq += 1
            seq = self._seq
        return PassRequest(
            owner=owner, served=served, state=state, seq=seq, enqueued_at=time.perf_counter(), **work
        )

    def submit_prefill(
        self, served: Any, tokens: Sequence[int], state: Any, *, prompt_end: int, owner: WorkOwner,
        follow_up: bool = False, chain: DecodeChain | None = None,
    ) -> Future:
        """Queue a prefill chunk; the future gets the compute's output (or its error) after its step.
        follow_up: the turn asks for its next pass as soon as this one returns (the loop waits briefly).
        chain: the turn's decode chain (a prompt's last chunk): the future gets a `Continued`, with the
        decode of the sampled token already queued when it is wanted."""
        request = self._request(owner, served, state, tokens=list(tokens), prompt_end=prompt_end,
                                follow_up=follow_up, chain=chain)  # fmt: skip
        return self._loop(served.name).submit(request)

    def submit_decode(
        self, served: Any, token: int, state: Any, *, owner: WorkOwner, follow_up: bool = False,
        chain: DecodeChain | None = None,
    ) -> Future:
        """Queue one decode token (follow_up and chain as `submit_prefill`).

        Raises:
            ValueError: no state to continue.
        """
        if state is None:
            raise ValueError("decode needs the state of the prompt it continues")
        request = self._request(owner, served, state, token=int(token), follow_up=follow_up, chain=chain)
        return self._loop(served.name).submit(request)

    def prefill(
        self, served: Any, tokens: Sequence[int], state: Any, *, prompt_end: int, owner: WorkOwner
    ) -> Any:
        return self.submit_prefill(served, tokens, state, prompt_end=prompt_end, owner=owner).result()

    def decode(self, served: Any, token: int, state: Any, *, owner: WorkOwner) -> Any:
        return self.submit_decode(served, token, state, owner=owner).result()

    def close(self) -> None:
        with self._lock:
            loops, self._loops = list(self._loops.values()), {}
        for loop in loops:
            loop.close()
