"""When rollouts are generated relative to training: sync, one-step-off, fully async.

Each schedule hands the loop one `RolloutBatch` per step and brackets every weight push
(`hold_engines`), so weights never change while a batch is being generated.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field

from miles_core.config import RunConfig
from miles_core.metrics import ASYNC_DROPPED_TOKENS
from miles_core.types import Sample


@dataclass
class RolloutBatch:
    samples: list[Sample]
    metrics: dict[str, float]
    version: int
    """Weight version the engines held while generating this batch."""
    cursor: dict = field(default_factory=dict)
    """Prompt-source state right after this batch was drawn (what a checkpoint stores)."""
    seconds: float = 0.0


Producer = Callable[[int, int], RolloutBatch]  # (step, engine weight version) -> batch
# rollout.partial: a producer round may finish no batch yet (None); its partial samples wait in the pool


class SyncSchedule:
    """Generate step k's batch, then train on it: always on-policy."""

    def __init__(self, produce: Producer, cfg: RunConfig):
        self.produce = produce

    def next(self, step: int, version: int) -> RolloutBatch:
        return self.produce(step, version)

    @contextmanager
    def hold_engines(self):
        yield

    def close(self) -> None:
        pass


class OneStepOffSchedule:
    """Generate step k+1 while step k trains; the push after step k waits for that
    generation to finish, so every batch is exactly one version behind the trainer."""

    def __init__(self, produce: Producer, cfg: RunConfig):
        self.produce, self.num_steps = produce, cfg.training.num_steps
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="one-step-off")
        self.pending: Future | None = None

    def next(self, step: int, version: int) -> RolloutBatch:
        batch = self.pending.result() if self.pending else self.produce(step, version)
        self.pending = self.pool.submit(self.produce, step + 1, version) if step + 1 < self.num_steps else None
        return batch

    @contextmanager
    def hold_engines(self):
        if self.pending is not None:
            self.pending.exception()  # waits; errors surface in next()
        yield

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


class FullyAsyncSchedule:
    """A persistent producer fills a bounded buffer with the newest weights it has; batches
    more than `max_weight_staleness` versions behind are dropped or regenerated. The producer
    starts a batch only while fewer than `max_weight_staleness` are made and unconsumed (see
    _may_start), so a producer faster than the trainer makes none that would be stale.

    With rollout.partial (and `engines`, which must offer pause(mode) and resume()), the producer
    runs rounds (see miles_core.rollout.partial_pool) and a weight update does not wait for a
    round: the engines are paused with mode=abort, so running requests return what they have
    (kept by the producer, continued with the new weights), and requests sent meanwhile are
    aborted again until the producer lets go of the engines."""

    def __init__(self, produce: Producer, cfg: RunConfig, engines=None):
        r = cfg.rollout
        self.produce, self.max_staleness, self.policy = produce, r.loop.max_weight_staleness, r.loop.stale_policy
        self.buffer: queue.Queue[RolloutBatch | BaseException] = queue.Queue(maxsize=r.loop.buffer_batches)
        self.engine_lock = threading.Lock()
        self.engine_version, self.produced = 0, 0
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        self.dropped, self.dropped_tokens = 0, 0
        self.engines = engines if r.partial.enabled else None
        self.update_waiting = threading.Event()
        """Set while hold_engines waits for the engines: the producer starts no round meanwhile."""
        self.handoff = threading.Lock()
        self.in_hand: RolloutBatch | None = None
        """A batch made and not yet in the buffer (full): with the buffer, what `unconsumed` sees."""
        self.ahead = max(self.max_staleness, 1)
        """Batches the producer keeps made and unconsumed at most (see _may_start)."""

    def _run(self) -> None:
        try:
            if self.in_hand is not None:  # restored: one batch more than the buffer holds
                self._hand_over()
            while self._may_start():
                with self.engine_lock:
                    batch = self.produce(self.produced, self.engine_version)
                    if batch is None:  # a partial round: no group set is complete yet
                        continue
                    self.in_hand = batch  # under the lock: a hold_engines sees it made, in hand or buffered
                self.produced += 1
                self._hand_over()
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            self.buffer.put(exc)

    def _may_start(self, interval: float = 0.01) -> bool:
        """Wait until the producer may start a batch or a partial round (False once stopped): no
        weight update is waiting for the engines, and fewer than `ahead` batches are made and
        unconsumed. A batch started at engine version V with Q such batches is taken after them,
        when the trainer is at most at V + Q + 1: with Q < max_weight_staleness it is never
        stale. At max_weight_staleness=0 every batch made ahead may be stale, and waiting for
        Q < 0 would make none: the producer stays one batch ahead, which the consumer drops (or
        regenerates) when an update came first."""
        while not self.stop.is_set():
            if not self.update_waiting.is_set() and len(self.unconsumed()) < self.ahead:
                return True
            time.sleep(interval)
        return False

    def _hand_over(self, interval: float = 0.05) -> None:
        """Move the batch in hand into the buffer once it has room (or until stopped); the batch is
        in exactly one of the two at any time `unconsumed` can look."""
        while not self.stop.is_set():
            with self.handoff:
                try:
                    self.buffer.put_nowait(self.in_hand)
                    self.in_hand = None
                    return
                except queue.Full:
                    pass
            time.sleep(interval)

    def unconsumed(self) -> list[RolloutBatch]:
        """Batches made and not yet handed to the loop, oldest first. Inside hold_engines the
        producer makes none, so with its pool and prompt cursor this is the producer's whole state
        (rollout.partial checkpoints it)."""
        with self.handoff:
            made = [b for b in list(self.buffer.queue) if isinstance(b, RolloutBatch)]
            return made + ([self.in_hand] if self.in_hand is not None else [])

    def restore(self, batches: list[RolloutBatch]) -> None:
        """A checkpoint's unconsumed batches, handed out before any new one (call before next)."""
        if self.thread is not None or len(batches) > self.buffer.maxsize + 1:
            raise ValueError(f"cannot restore {len(batches)} batches into a buffer of {self.buffer.maxsize} "
                             "(plus one in hand) once started or beyond its size")
        for batch in batches[: self.buffer.maxsize]:
            self.buffer.put_nowait(batch)
        self.in_hand = batches[self.buffer.maxsize] if len(batches) > self.buffer.maxsize else None

    def next(self, step: int, version: int) -> RolloutBatch:
        if self.thread is None:
            self.engine_version, self.produced = version, step
            self.thread = threading.Thread(target=self._run, name="rollout-producer", daemon=True)
            self.thread.start()
        while True:
            item = self.buffer.get()
            if isinstance(item, BaseException):
                raise item
            staleness = version - item.version
            if staleness <= self.max_staleness:
                return self._counted(item, version)
            self.dropped += 1
            self.dropped_tokens += sum(len(s.response_ids) for s in item.samples)
            if self.policy == "retry":  # regenerate now, with the current weights
                fresh = None
                while fresh is None:  # rollout.partial: rounds until a batch is complete
                    with self.engine_lock:
                        fresh = self.produce(step, self.engine_version)
                return self._counted(fresh, version)

    def _counted(self, batch: RolloutBatch, version: int) -> RolloutBatch:
        batch.metrics |= {"async/staleness": float(version - batch.version), "async/dropped_batches": float(self.dropped),
                          ASYNC_DROPPED_TOKENS: float(self.dropped_tokens)}
        return batch

    @contextmanager
    def hold_engines(self):
        self.update_waiting.set()
        if self.engines is not None:
            self._interrupt_round()
        else:
            self.engine_lock.acquire()
        try:
            yield
            self.engine_version += 1
        finally:
            if self.engines is not None:
                self.engines.resume()
            self.engine_lock.release()
            self.update_waiting.clear()

    def _interrupt_round(self, interval: float = 0.05) -> None:
        """Pause the engines (mode=abort) until the producer's round returns and frees the lock."""
        self.engines.pause("abort")
        while not self.engine_lock.acquire(timeout=interval):
            self.engines.pause("abort")  # what the round sent after the first pause is held: abort it

    def close(self) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join(timeout=60)


SCHEDULES = {"sync": SyncSchedule, "one_step_off": OneStepOffSchedule, "fully_async": FullyAsyncSchedule}


def timed(produce: Callable[[int, int], RolloutBatch]) -> Producer:
    def run(step: int, version: int) -> RolloutBatch:
        started = time.perf_counter()
        batch = produce(step, version)
        if batch is not None:
            batch.seconds = time.perf_counter() - started
        return batch

    return run
