"""What a custom generate function (`rollout.generate`) is handed: `ctx.generate` speaks SGLang's
batch /generate (token ids in; output ids, log-probs, finish reasons out) and `ctx.tokenizer`.

The functions of one rollout batch run concurrently, one per prompt. Their engine calls are
merged: once every running function waits on the engine, all their calls go out as one request
per engine (the embedded engine runs one request at a time, and generation is fast in big
batches; SGLang batches either way). A function that does slow work between turns (a tool
call) holds the next merge back until it calls the engine again or returns.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from miles_core.rollout.router import generate_in_shards

if TYPE_CHECKING:
    from miles_core.types import Prompt

SAMPLE_ONLY = ("sampling_seed",)  # per-sample keys; the rest of the params must agree to share a request


@dataclass
class _Call:
    worker: int
    input_ids: list[list[int]]
    sampling_params: list[dict[str, Any]]
    extra: dict[str, Any]
    done: threading.Event = field(default_factory=threading.Event)
    outputs: list[dict] | None = None
    error: BaseException | None = None

    key: tuple = ()
    """Calls of equal key (the params but the seed, the request flags) share one request."""


class MergingEngineClient:
    """Merges the concurrent engine calls of `num_workers` generate functions (see module doc)."""

    def __init__(self, engines: Any, num_workers: int, request_extra: dict[str, Any], pool: ThreadPoolExecutor):
        self.engines, self.request_extra, self.pool = engines, request_extra, pool
        self.active = num_workers
        self.pending: list[_Call] = []
        self.lock = threading.Lock()

    def generate(self, worker: int, input_ids: list[list[int]], sampling_params: list[dict[str, Any]]) -> list[dict]:
        call = _Call(worker, input_ids, sampling_params, dict(self.request_extra),
                     key=_request_key(input_ids, sampling_params, self.request_extra))
        if not input_ids:
            return []
        with self.lock:
            self.pending.append(call)
            ready = self._take_if_all_wait()
        self._send(ready)
        call.done.wait()
        if call.error is not None:
            raise call.error
        return call.outputs

    def finished(self) -> None:
        """One generate function returned (or raised): it no longer holds a merge back."""
        with self.lock:
            self.active -= 1
            ready = self._take_if_all_wait()
        self._send(ready)

    def _take_if_all_wait(self) -> list[_Call]:
        if not self.pending or len({c.worker for c in self.pending}) < self.active:
            return []
        ready, self.pending = self.pending, []
        return sorted(ready, key=lambda c: c.worker)  # request order independent of thread timing

    def _send(self, calls: list[_Call]) -> None:
        groups: dict[tuple, list[_Call]] = {}
        for call in calls:
            groups.setdefault(call.key, []).append(call)
        for group in groups.values():
            try:
                outputs = generate_in_shards(self.pool, functools.partial(self.engines.generate, **group[0].extra),
                                             [ids for c in group for ids in c.input_ids],
                                             [p for c in group for p in c.sampling_params], self.engines.num_healthy)
                if len(outputs) != sum(len(c.input_ids) for c in group):
                    raise RuntimeError(f"the engines answered {len(outputs)} outputs for "
                                       f"{sum(len(c.input_ids) for c in group)} prompts")
                for call in group:
                    call.outputs, outputs = outputs[: len(call.input_ids)], outputs[len(call.input_ids):]
            except BaseException as exc:  # noqa: BLE001 - relayed: each waiting function raises it
                for call in group:
                    call.error = exc
            finally:  # no function may wait forever
                for call in group:
                    call.done.set()


class RolloutContext:
    """One generate function's handle: `generate` and `tokenizer` (see module doc)."""

    def __init__(self, client: MergingEngineClient, worker: int, tokenizer: Any):
        self._client, self._worker, self.tokenizer = client, worker, tokenizer

    def generate(self, input_ids: list[list[int]], sampling_params: list[dict[str, Any]]) -> list[dict]:
        """SGLang's /generate for a batch of token-id prompts, one sampling-params dict each
        (they may differ only in sampling_seed), with log-probs: one output dict per prompt,
        {"output_ids", "text", "meta_info": {"output_token_logprobs", "finish_reason",
        "weight_version", ...}}."""
        return self._client.generate(self._worker, input_ids, sampling_params)


def _request_key(input_ids: list[list[int]], sampling_params: Any, extra: dict[str, Any]) -> tuple:
    """Checks one call (before it can hold a merge) and returns what it may be merged on."""
    if not isinstance(sampling_params, list) or len(sampling_params) != len(input_ids):
        raise ValueError(f"ctx.generate takes one sampling_params dict per prompt: got "
                         f"{type(sampling_params).__name__} for {len(input_ids)} prompts")
    if not all(isinstance(p, dict) for p in sampling_params):
        raise ValueError("ctx.generate: every sampling_params entry must be a dict")
    shared = {repr(sorted((k, v) for k, v in p.items() if k not in SAMPLE_ONLY)) for p in sampling_params}
    if len(shared) > 1:
        raise ValueError(f"ctx.generate: one call's sampling_params may differ only in {SAMPLE_ONLY}; "
                         "make one call per set of params")
    return repr(sorted(extra.items())), *shared


def run_generate_fn(fn: Callable[..., Any], engines: Any, prompts: list[Prompt], params: list[list[dict[str, Any]]],
                    tokenizer: Any, pool: ThreadPoolExecutor, request_extra: dict[str, Any] | None = None) -> list[Any]:
    """fn(ctx, prompt, params[i]) for every prompt, concurrently, engine calls merged; the
    results in prompt order. `engines`: num_healthy and SGLang's batch generate."""
    client = MergingEngineClient(engines, len(prompts), request_extra or {}, pool)

    def run(position: int) -> Any:
        try:
            return fn(RolloutContext(client, position, tokenizer), prompts[position], params[position])
        finally:
            client.finished()

    with ThreadPoolExecutor(max_workers=max(1, len(prompts)), thread_name_prefix="generate") as workers:
        return list(workers.map(run, range(len(prompts))))

