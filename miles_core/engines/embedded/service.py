"""The embedded engine's server state: the engine, its lock, requests in flight, the pause
gate and the weight-update groups, with SGLang's semantics for each (starting weight version,
per-request seeds, flush_cache, checkpoint names over HTTP). `http_server` puts SGLang's HTTP
routes in front of it.

Generation runs in a worker thread so health and abort stay responsive; one lock serialises
generation and weight updates, so weights never change mid-generation.

Weight updates are atomic as a client sees them: from the first tensor a bucketed update writes
until its last bucket (the one with flush_cache=true, inside a weight-update session), or after
an update failed part-way, the live weights are a mix of no version. Meanwhile the health probes
answer 503 and generation is refused (503), until a complete update (or a restart); the weight
version changes only when an update completes.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from miles_core.engines.embedded.engine import EmbeddedEngine, split_sampling_params
from miles_core.engines.embedded.lora import LoRAServing
from miles_core.engines.embedded.retract import continuation_seed, merge_continuation, unfinished_rows
from miles_core.net import init_custom_process_group
from miles_core.weight_sync.layout import checkpoint_layout
from miles_core.weight_sync.lora import is_adapter_payload

logger = logging.getLogger(__name__)
DTYPES = {"auto": "float32", "float": "float32", "half": "float16"}
# What EmbeddedEngine honours; other SGLang sampling params (stop strings, min_p, penalties,
# min_new_tokens) are accepted and ignored, with one warning per key.
SUPPORTED_SAMPLING = {"temperature", "top_p", "top_k", "max_new_tokens", "stop_token_ids", "ignore_eos",
                      "sampling_seed"}
# The JSON contract of SGLang 0.5.23's /generate sampling_params (sglang/api/v1/api_types.py,
# SamplingParams: unknown keys rejected): each field and the JSON type it must have (None: any).
SGLANG_SAMPLING_JSON: dict[str, type | None] = {
    **dict.fromkeys(("max_new_tokens", "top_k", "min_new_tokens", "n", "stream_interval", "sampling_seed",
                     "beam_width"), int),
    **dict.fromkeys(("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty",
                     "repetition_penalty"), float),
    **dict.fromkeys(("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"), bool),
    **dict.fromkeys(("stop", "stop_token_ids", "stop_regex", "json_schema", "regex", "ebnf", "structural_tag",
                     "logit_bias", "custom_params", "watermark", "choice"), None),
}


class Request:
    """One /generate call in flight (a batch shares one record: aborting any of its rids
    aborts the whole call, since the batch is one transformers generate)."""

    def __init__(self, rids: list[str]):
        self.rids = rids
        self.aborted = threading.Event()
        self.stopped_early = False
        self.retracted = False
        """Its running call was cut by pause_generation(mode=retract): it continues after continue."""
        self.adapter: str | None = None
        """The LoRA adapter it names (`lora_path`), admitted by LoRAServing.acquire; None: the base."""


class EngineService:
    """Everything behind the routes: the engine, its lock, in-flight requests, the pause gate
    and the weight-update groups."""

    def __init__(self, model_path: str, tokenizer_path: str | None = None, server_args: dict | None = None,
                 dtype: str = "float32", num_threads: int | None = None, weight_version: str | None = None,
                 group_timeout_seconds: float = 600.0, api_key: str | None = None):
        self.model_path = str(model_path)
        self.tokenizer_path = str(tokenizer_path or model_path)
        self.server_args = dict(server_args or {})
        self.dtype = DTYPES.get(dtype, dtype)
        self.num_threads = num_threads
        self.initial_version = weight_version
        self.group_timeout_seconds = group_timeout_seconds
        self.api_key = api_key
        """Required as `Authorization: Bearer <key>` on every route but the health probes."""
        self.engine: EmbeddedEngine | None = None
        self.load_error: BaseException | None = None
        self.loaded = threading.Event()
        self.lock = threading.Lock()
        # Generation calls queue on this one thread (the engine runs one at a time) instead of
        # each holding a thread of the server's pool while it waits, which weight updates need.
        self.generation_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-generate")
        self.current: Request | None = None
        self.requests: dict[int, Request] = {}
        self.paused = False
        self.retracting = False
        """pause_generation(mode=retract) is on: the running call ends at its next decode step."""
        self.stale_cache_version: str | None = None
        """Set when weights changed with flush_cache=false: SGLang's radix cache would then serve
        KV computed with the old weights, so generation is refused until /flush_cache."""
        self.groups: dict[str, Any] = {}
        self.weight_update_selector: str | None = None
        """The open weight-update session's selector (SGLang 0.5.23: distributed updates load
        only between /begin_weight_update and /end_weight_update)."""
        self.weights_incomplete: str | None = None
        """Why the live weights are no complete version (an update under way or failed part-way),
        or None. While set, health is 503 and generation refused."""
        self.session_failed = False
        """A bucket of the open session failed: its later buckets would complete a mix."""
        self.warned_params: set[str] = set()
        self.lora = LoRAServing(self.server_args)
        """LoRA adapters by name (SGLang's --enable-lora and LoRA routes; see engines/embedded/lora.py)."""

    # ---- lifecycle -------------------------------------------------------------------------

    def load(self) -> None:
        try:
            engine = EmbeddedEngine(self.model_path, dtype=self.dtype, num_threads=self.num_threads,
                                    **engine_args(self.server_args))
            if self.initial_version is not None:  # else SGLang's start, "default" (EmbeddedEngine's too)
                engine.weight_version = str(self.initial_version)
            engine.interrupted = self._running_request_aborted
            self.engine = engine
        except BaseException as exc:  # surfaced by wait_ready / the health endpoint's log
            logger.exception("loading %s failed", self.model_path)
            self.load_error = exc
        finally:
            self.loaded.set()

    @property
    def ready(self) -> bool:
        return self.engine is not None

    @property
    def healthy(self) -> bool:
        """Loaded, and holding the weights of one complete version."""
        return self.ready and self.weights_incomplete is None

    # ---- requests, abort and pause --------------------------------------------------------

    def register(self, rids: list[str]) -> Request:
        req = Request(rids)
        self.requests[id(req)] = req
        return req

    def unregister(self, req: Request) -> None:
        self.requests.pop(id(req), None)

    def abort(self, rid: str | None = None) -> int:
        hits = [r for r in list(self.requests.values()) if rid is None or rid in r.rids]
        for req in hits:
            req.aborted.set()
        return len(hits)

    async def wait_unpaused(self, req: Request) -> None:
        # Polling keeps one code path for both wake-ups (continue, or an abort from any thread).
        while self.paused and not req.aborted.is_set():
            await asyncio.sleep(0.02)

    def pause(self, mode: str) -> None:
        """SGLang's modes (see miles_core.engines.embedded.retract): 'abort' ends running and queued
        requests (their tokens so far, finish_reason abort); 'retract' ends the running call at
        its next decode step and holds its requests, which continue after /continue_generation
        from prompt + tokens so far (re-prefilled with the weights held then; one response to the
        client); 'in_place' lets the running batch finish (one transformers call cannot be
        suspended, and KV kept across a weight update would be stale). All hold new requests."""
        self.paused = True
        if mode == "abort":
            self.abort()
        self.retracting = mode == "retract"

    def resume(self) -> None:
        """/continue_generation: held and retracted requests go on."""
        self.retracting = False
        self.paused = False

    # ---- generation (worker thread) -------------------------------------------------------

    def _running_request_aborted(self) -> bool:
        """The engine's interrupt check, between decode steps: /abort_request ends the running batch."""
        req = self.current
        if req is not None and req.aborted.is_set():
            req.stopped_early = True
            return True
        if req is not None and self.retracting:
            req.retracted = True
            return True
        return False

    def generate(self, req: Request, prompts: list[list[int]], body: dict) -> list[dict]:
        params, seeds = self._sampling_params(body.get("sampling_params"), len(prompts))
        start = body.get("logprob_start_len")
        score_from = int(start) if bool(body.get("return_logprob")) and start is not None and int(start) >= 0 else None
        outs = self._run(req, prompts, params, seeds, body, score_from)
        while req.retracted:
            req.retracted = False
            while self.paused and not req.aborted.is_set():  # the lock is free: weight updates run
                req.aborted.wait(0.02)
            if req.aborted.is_set():  # aborted while retracted: it returns what it has
                req.stopped_early = True
                break
            outs = self._continue_retracted(req, prompts, outs, params, seeds, body)
        if req.stopped_early:
            for out in outs:
                out["meta_info"]["finish_reason"] = {"type": "abort", "message": "aborted by request"}
        return outs

    def _run(self, req: Request, prompts: list[list[int]], params: dict, seeds: list[int] | None, body: dict,
             score_from: int | None) -> list[dict]:
        """One engine call under the lock (the weights' state is read under the lock updates hold)."""
        with self.lock:
            self.check_servable()
            self.lora.apply(req.adapter, self.engine.model.state_dict)
            if req.aborted.is_set():
                return [self._empty(p, {"type": "abort", "message": "aborted before it ran"}) for p in prompts]
            self.current = req
            try:
                if int(params["max_new_tokens"]) == 0:
                    outs = [self._empty(p, {"type": "length", "length": 0}) for p in prompts]
                else:
                    outs = self.engine.generate(prompts, params, return_logprob=bool(body.get("return_logprob")),
                                                seeds=seeds,
                                                return_routed_experts=bool(body.get("return_routed_experts")))
                if score_from is not None:
                    self._score_all(req, outs, prompts, score_from)
                return outs
            finally:
                self.current = None

    def _continue_retracted(self, req: Request, prompts: list[list[int]], outs: list[dict], params: dict,
                            seeds: list[int] | None, body: dict) -> list[dict]:
        """The rows a retract cut short, re-prefilled from prompt + tokens so far with the weights
        held now; their new tokens append (one call, at the largest remaining budget)."""
        max_new = int(params["max_new_tokens"])
        rows = unfinished_rows(outs, max_new)
        if not rows:
            return outs
        budgets = [max_new - len(outs[i]["output_ids"]) for i in rows]
        inputs = [prompts[i] + outs[i]["output_ids"] for i in rows]
        row_seeds = None if seeds is None else [continuation_seed(seeds[i], len(outs[i]["output_ids"])) for i in rows]
        more = self._run(req, inputs, params | {"max_new_tokens": max(budgets)}, row_seeds, body, None)
        merged = list(outs)
        for i, budget, out in zip(rows, budgets, more):
            merged[i] = merge_continuation(outs[i], out, budget, self.engine.tokenizer)
        return merged

    def check_servable(self) -> None:
        """EngineUnavailable while the weights are no complete version; ValueError (the caller's
        400) while the cache holds KV of replaced weights."""
        if self.weights_incomplete is not None:
            raise EngineUnavailable(f"the engine holds no complete weight version: {self.weights_incomplete}")
        if self.stale_cache_version is not None:
            raise ValueError(f"weights changed to version {self.stale_cache_version} with flush_cache=false and "
                             "the cache was not flushed since: SGLang would reuse prefix KV of the old weights")

    def _score_all(self, req: Request, outs: list[dict], prompts: list[list[int]], start: int) -> None:
        """Input log-probs of each prompt, one forward each; an abort ends the call between them."""
        for out, prompt in zip(outs, prompts):
            if req.aborted.is_set():
                req.stopped_early = True
                return
            out["meta_info"]["input_token_logprobs"] = self._score(prompt, start)

    def _sampling_params(self, params: dict | list | None, num_prompts: int) -> tuple[dict, list[int] | None]:
        """One set of params for the batch and the sampling seed of each prompt (see
        engine.split_sampling_params), with SGLang's default budget."""
        for one in params if isinstance(params, list) else [params or {}]:
            check_sampling_json(one)
        shared, seeds = split_sampling_params(params or {}, num_prompts)
        merged = {"max_new_tokens": 128, **shared}  # 128 is SGLang's default
        verify_sampling(merged)
        for key in sorted(set(merged) - SUPPORTED_SAMPLING - self.warned_params):
            logger.warning("sampling param %r is ignored by the embedded engine", key)
            self.warned_params.add(key)
        return merged, seeds

    def _empty(self, prompt: list[int], finish: dict) -> dict:
        meta = {"finish_reason": finish, "prompt_tokens": len(prompt), "completion_tokens": 0,
                "output_token_logprobs": [], "weight_version": self.engine.weight_version}
        return {"text": "", "output_ids": [], "meta_info": meta}

    @torch.no_grad()
    def _score(self, prompt: list[int], start: int) -> list[list]:
        """[logprob, token_id, None] per input token from `start`; position 0 has no context,
        so its logprob is None (as in SGLang)."""
        ids = torch.tensor([prompt], device=self.engine.device)
        logits = self.engine.model(input_ids=ids).logits[0].float()
        picked = torch.log_softmax(logits[:-1], dim=-1).gather(-1, ids[0, 1:, None]).squeeze(-1).tolist()
        entries = [[None, prompt[0], None]] + [[lp, tok, None] for lp, tok in zip(picked, prompt[1:])]
        return entries[start:]

    # ---- weights (worker thread) ----------------------------------------------------------

    def load_tensors(self, tensors: dict[str, torch.Tensor], weight_version: str | None,
                     flush_cache: bool = True, checkpoint_names_only: bool = True) -> dict:
        """Copy (a subset of) HF-named tensors into the live model. Callers hold self.lock.
        Over HTTP only checkpoint names are taken (SGLang's loaders skip transformers' fused
        MoE expert names without an error); in-process tensors may use either layout.
        An adapter payload (miles_core.weight_sync.lora) is merged into the engine's unmerged base
        copy first."""
        adapters = is_adapter_payload(tensors)
        if adapters:
            try:
                tensors = self.engine.adapters.merged(self.engine.model.state_dict(), tensors)
            except KeyError as exc:
                return weight_result(False, str(exc))
        targets = self.resolve_targets(tensors, checkpoint_names_only)
        if isinstance(targets, str):
            return weight_result(False, targets)
        return self.copy_into(targets, list(tensors.values()), weight_version, flush_cache, adapters=adapters)

    def resolve_targets(self, tensors: dict[str, torch.Tensor],
                        checkpoint_names_only: bool = True) -> list[torch.Tensor] | str:
        """The live model's tensors these names and shapes load into, in order; or why not.
        A caller that loads the same names every time (the shared buffer) resolves them once."""
        live = self.engine.model.state_dict()  # shares storage with the parameters
        state = checkpoint_layout(live)  # per-expert MoE names: views into the fused experts
        if not checkpoint_names_only:
            state |= live
        unknown = sorted(set(tensors) - set(state))
        if unknown:
            return f"unknown parameter names: {unknown[:5]}"
        wrong = [n for n, t in tensors.items() if tuple(t.shape) != tuple(state[n].shape)]
        if wrong:
            return f"shape mismatch for {wrong[:5]}"
        return [state[n] for n in tensors]

    @torch.no_grad()
    def copy_into(self, targets: list[torch.Tensor], sources: list[torch.Tensor], weight_version: str | None,
                  flush_cache: bool = True, adapters: bool = False) -> dict:
        """One fused copy of resolved sources into their targets. Callers hold self.lock.
        A write of full weights (not merged adapters) replaces the base adapters merge into.
        Inside a weight-update session a write with flush_cache=false is a bucket with more to
        come (senders flush once, after the last bucket), so the weights stay marked incomplete
        and the version unchanged until that last bucket; outside one, every write is whole."""
        if self.session_failed and self.weight_update_selector is not None:
            return weight_result(False, FAILED_SESSION)
        final = flush_cache or self.weight_update_selector is None
        # Marked before the copy: a copy that raises part-way leaves a mix, and says so.
        self.weights_incomplete = self.weights_incomplete or f"an update to weight version {weight_version} is loading"
        if not adapters:
            self.engine.adapters.forget()
            self.lora.weights_replaced()
        try:
            self.engine.copy_weights(targets, sources)
        except BaseException as exc:
            self.write_failed(weight_version, exc)
            raise
        if not final:
            self.weights_incomplete = (f"an update to weight version {weight_version} is under way; it completes "
                                       "with its last bucket (flush_cache=true)")
            return weight_result(True, f"loaded a bucket of {len(targets)} tensors of weight version {weight_version}")
        self.weights_incomplete = None
        if weight_version is not None:
            self.engine.weight_version = str(weight_version)
        self.stale_cache_version = None if flush_cache else self.engine.weight_version
        return weight_result(True, f"updated {len(targets)} tensors; weight version {self.engine.weight_version}")

    def write_failed(self, weight_version: str | None, exc: BaseException) -> None:
        """A write raised: the weights are a mix if it or an earlier bucket of its update touched
        them, and the rest of its session could only complete that mix."""
        if self.weight_update_selector is not None:
            self.session_failed = True
        if self.weights_incomplete is not None:
            self.weights_incomplete = (f"an update to weight version {weight_version} failed part-way "
                                       f"({type(exc).__name__}: {exc}); waiting for a complete update")
        logger.error("weight update to version %s failed: %s: %s", weight_version, type(exc).__name__, exc)

    def release_memory(self, tags: list[str] | None) -> dict:
        """Free weights and/or KV cache (time-sharing the GPU with a trainer). Waits for the
        running generation; with weights released, generation is refused (503) until they are
        resumed and a complete weight version is loaded, as SGLang requires."""
        with self.lock:
            self.engine.release_memory(tags)
            if self.engine.released_weights:
                self.weights_incomplete = ("weights released by /release_memory_occupation: resume them "
                                           "(/resume_memory_occupation tags=[weights]) and load a weight version")
        return weight_result(True, f"released {sorted(tags or ['all'])}")

    def resume_memory(self, tags: list[str] | None) -> dict:
        with self.lock:
            had_released = bool(self.engine.released_weights)
            self.engine.resume_memory(tags)
            if had_released and not self.engine.released_weights:
                self.weights_incomplete = "weights resumed without their contents: load a weight version"
        return weight_result(True, f"resumed {sorted(tags or ['all'])}")

    def update_from_disk(self, body: dict) -> dict:
        if self.session_failed and self.weight_update_selector is not None:
            return weight_result(False, FAILED_SESSION)
        model_path = body.get("model_path", "")
        files = sorted(Path(model_path).glob("*.safetensors"))
        if not files:
            return weight_result(False, f"no *.safetensors files in {model_path}")
        tensors: dict[str, torch.Tensor] = {}
        for file in files:
            tensors.update(load_file(str(file)))
        with self.lock:
            result = self.load_tensors(tensors, body.get("weight_version"), _flush(body))
        if result["success"]:
            self.model_path = str(model_path)
        return result

    def load_lora_adapter(self, body: dict) -> dict:
        return self.lora.load(body["lora_name"], body["lora_path"], self.weight_shapes())

    def unload_lora_adapter(self, body: dict) -> dict:
        return self.lora.unload(body["lora_name"])

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(t.shape) for name, t in self.engine.model.state_dict().items()}

    def init_group(self, body: dict) -> dict:
        name = body["group_name"]
        if name in self.groups:
            return weight_result(False, f"group {name!r} already exists")
        self.groups[name] = init_custom_process_group(
            backend=body.get("backend", "gloo"),
            init_method=f"tcp://{body['master_address']}:{body['master_port']}",
            world_size=int(body["world_size"]), rank=int(body["rank_offset"]), group_name=name,
            timeout=timedelta(seconds=self.group_timeout_seconds))
        return weight_result(True, f"joined group {name!r} as rank {body['rank_offset']}")

    def begin_weight_update(self, body: dict) -> dict:
        selector = body.get("selector", "all")
        if selector not in WEIGHT_UPDATE_SELECTORS:
            return weight_result(False, f"selector must be one of {', '.join(WEIGHT_UPDATE_SELECTORS)}, got {selector!r}")
        if self.weight_update_selector is not None:
            return weight_result(False, "a weight-update session is already open; call end_weight_update() first")
        self.weight_update_selector, self.session_failed = selector, False
        return weight_result(True, "Success")

    def end_weight_update(self, body: dict) -> dict:
        if self.weight_update_selector is None:
            return weight_result(False, "no weight-update session is open; call begin_weight_update() first")
        # Weights left incomplete stay so (and unservable) with or without a session open.
        if self.weights_incomplete is not None and not self.session_failed:
            self.weights_incomplete = ("a weight-update session ended before its update's last bucket "
                                       "(flush_cache=true) loaded; waiting for a complete update")
        self.weight_update_selector = None
        return weight_result(True, "Success")

    def update_from_distributed(self, body: dict) -> dict:
        if self.weight_update_selector is None:
            return weight_result(False, "update_weights_from_distributed must run between begin_weight_update() "
                                        "and end_weight_update()")
        group = self.groups.get(body.get("group_name"))
        if group is None:
            return weight_result(False, f"no weights update group {body.get('group_name')!r}; call init first")
        if self.session_failed:
            return weight_result(False, FAILED_SESSION)
        declared = _declared_tensors(body["names"], body["dtypes"], body["shapes"])
        # Checked before a byte is received: a wrong name or shape must not cost an allocation.
        targets = declared if isinstance(declared, str) else self.resolve_targets(declared)
        if isinstance(targets, str):
            return weight_result(False, targets)
        with self.lock:
            try:
                received = [self._receive(t, group) for t in declared.values()]
            except BaseException as exc:  # the sender died or the group broke mid-bucket
                self.write_failed(body.get("weight_version"), exc)
                raise
            return self.copy_into(targets, received, body.get("weight_version"), _flush(body))

    def _receive(self, declared: torch.Tensor, group: Any) -> torch.Tensor:
        tensor = torch.empty(declared.shape, dtype=declared.dtype, device=self.engine.device)
        torch.distributed.broadcast(tensor, src=0, group=group)
        return tensor

    def destroy_group(self, body: dict) -> dict:
        name = body.get("group_name", "")
        group = self.groups.pop(name, None)
        if group is None:
            return weight_result(False, f"no weights update group {name!r}")
        torch.distributed.destroy_process_group(group)
        return weight_result(True, f"destroyed group {name!r}")

    def weights_sha256(self) -> str:
        with self.lock:
            return self.engine.weights_sha256()


def engine_args(server_args: dict) -> dict:
    """SGLang's flags EmbeddedEngine honours, as it takes them: --max-running-requests (sequences
    decoded at once), --mem-fraction-static and --quantization."""
    args = {}
    if server_args.get("quantization") is not None:
        args["quantization"] = str(server_args["quantization"])
    if server_args.get("max_running_requests") is not None:
        args["max_batch_size"] = int(server_args["max_running_requests"])
    if server_args.get("mem_fraction_static") is not None:
        args["mem_fraction_static"] = float(server_args["mem_fraction_static"])
    return args


def check_sampling_json(params: dict) -> None:
    """ValueError (a 400), in SGLang's words, for a key SGLang's sampling params do not have or a
    value of the wrong JSON type (an integer field given 128.0, say); null means the default."""
    if not isinstance(params, dict):
        raise ValueError("invalid type: sampling_params, expected struct SamplingParams")
    for key, value in params.items():
        if key not in SGLANG_SAMPLING_JSON:
            raise ValueError(f"unknown field `{key}`, expected one of {', '.join(f'`{k}`' for k in SGLANG_SAMPLING_JSON)}")
        kind = SGLANG_SAMPLING_JSON[key]
        if value is None or kind is None:
            continue
        ok = (isinstance(value, bool) if kind is bool else
              isinstance(value, (int, float)) and not isinstance(value, bool) and (kind is float or isinstance(value, int)))
        if not ok:
            raise ValueError(f"invalid type: {value!r} for `{key}`, expected {'i64' if kind is int else kind.__name__}")


def verify_sampling(params: dict) -> None:
    """SGLang's SamplingParams.verify, in its words, for the params whose bad values would otherwise
    reach the sampler (a NaN temperature, a negative budget); null means the default. The engine
    checks top_p and top_k itself (EmbeddedEngine._sampling)."""
    def get(key: str, default: float) -> float:
        value = params.get(key)
        return default if value is None else value

    temperature, min_p = get("temperature", 1.0), get("min_p", 0.0)
    if not math.isfinite(temperature) or temperature < 0.0:
        raise ValueError(f"temperature must be a non-negative finite number, got {temperature}.")
    if not 0.0 <= min_p <= 1.0:
        raise ValueError(f"min_p must be in [0, 1], got {min_p}.")
    for key in ("frequency_penalty", "presence_penalty"):
        if not -2.0 <= get(key, 0.0) <= 2.0:
            raise ValueError(f"{key} must be in [-2, 2], got {get(key, 0.0)}.")
    if not 0.0 < get("repetition_penalty", 1.0) <= 2.0:
        raise ValueError(f"repetition_penalty must be in (0, 2] (1.0 = no penalty), got {get('repetition_penalty', 1.0)}.")
    max_new, min_new = get("max_new_tokens", 128), get("min_new_tokens", 0)
    if max_new < 0:
        raise ValueError(f"max_new_tokens must be at least 0, got {max_new}.")
    if not 0 <= min_new <= max_new:
        raise ValueError(f"min_new_tokens must be in [0, max_new_tokens({max_new})], got {min_new}.")


WEIGHT_UPDATE_SELECTORS = ("target", "draft", "all")  # SGLang's BeginWeightUpdateReqInput.selector


class EngineUnavailable(Exception):
    """The engine cannot serve now (its weights are no complete version): a 503, so routers try
    another engine, never the caller's error."""


FAILED_SESSION = ("an earlier bucket of this weight-update session failed, so its later buckets would complete a "
                  "mix; end the session and send a complete update")


def _declared_tensors(names: list[str], dtypes: list[str], shapes: list[list[int]]) -> dict[str, torch.Tensor] | str:
    """The tensors a bucket announces, as meta tensors (no memory), or why they cannot be received:
    the broadcast must receive exactly what the sender sends, one tensor per name, in order."""
    if not len(names) == len(dtypes) == len(shapes):
        return f"{len(names)} names, {len(dtypes)} dtypes and {len(shapes)} shapes: a bucket needs one of each per tensor"
    if len(set(names)) != len(names):
        return "a bucket names a tensor twice"
    if any(d < 0 for shape in shapes for d in shape):
        return "negative dimension in shapes"
    return {n: torch.empty(shape, dtype=_torch_dtype(d), device="meta") for n, d, shape in zip(names, dtypes, shapes)}


def _flush(body: dict) -> bool:
    return bool(body.get("flush_cache", True))  # SGLang's default


def weight_result(success: bool, message: str) -> dict:
    return {"success": success, "message": message}


def _torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype
