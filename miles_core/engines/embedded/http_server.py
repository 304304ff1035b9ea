"""The embedded engine behind SGLang's native HTTP API (the subset an RL trainer uses).

It lets CPU CI run the exact HTTP path a GPU cluster runs against `sglang.launch_server`:
the same client, launcher, router and weight-update calls. Launch it like SGLang:

    python -m miles_core.engines.embedded.http_server --model-path DIR --host 127.0.0.1 --port 30000

The routes are thin: what they do is `service.EngineService`'s. What a body may be is
`http_requests`'; what one client may ask and how long it may take, `http_limits`'.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from miles_core.engines.embedded.engine import EmbeddedEngine
from miles_core.engines.embedded.http_limits import RequestGate, ServerLimits, timed_protocol
from miles_core.engines.embedded.http_requests import (
    AbortReq,
    BeginWeightUpdateReqInput,
    ContinueGenerationReqInput,
    DestroyWeightsUpdateGroupReqInput,
    EndWeightUpdateReqInput,
    GenerateReqInput,
    InitWeightsUpdateGroupReqInput,
    LoadLoRAAdapterReqInput,
    MemoryOccupationReqInput,
    PauseGenerationReqInput,
    RequestError,
    SGLangStruct,
    UnloadLoRAAdapterReqInput,
    UpdateWeightFromDiskReqInput,
    UpdateWeightsFromDistributedReqInput,
    UpdateWeightVersionReqInput,
    _error,
    _json,
    _parse,
    _sglang_error,
    _validated,
)
from miles_core.engines.embedded.service import EngineService, EngineUnavailable, weight_result
from miles_core.engines.embedded.service import Request as InFlight
from miles_core.engines.sglang.args import LIST_ARGS, SERVER_ARGS
from miles_core.weight_sync.lora import payload_bytes
from miles_core.weight_sync.shared import BufferHandle, SharedWeights

logger = logging.getLogger(__name__)
SERVER_VERSION = "miles-embedded-1"


def create_app(service: EngineService, limits: ServerLimits | None = None) -> FastAPI:
    limits = limits or ServerLimits()
    app = FastAPI(title="miles embedded engine (SGLang API)", openapi_url=None)
    _add_info_routes(app, service)
    _add_generate_routes(app, service, limits)
    _add_control_routes(app, service)
    _add_weight_routes(app, service)
    app.add_exception_handler(RequestError, lambda _, exc: _sglang_error(exc.status, exc.message))
    app.add_exception_handler(StarletteHTTPException,
                              lambda _, exc: _sglang_error(exc.status_code, str(exc.detail), exc.headers))
    app.add_middleware(RequestGate, service=service, max_bytes=limits.max_request_bytes)
    return app


def _add_info_routes(app: FastAPI, service: EngineService) -> None:
    @app.get("/health")
    @app.get("/health_generate")
    async def health() -> Response:
        # 503 also while the weights are no complete version: routers and restarts go by this
        return Response(status_code=200 if service.healthy else 503)

    @app.get("/model_info")
    @app.get("/get_model_info")  # SGLang's deprecated alias
    async def model_info() -> dict:
        return {"model_path": service.model_path, "tokenizer_path": service.tokenizer_path,
                "is_generation": True, "preferred_sampling_params": None,
                "weight_version": service.engine.weight_version}

    @app.get("/server_info")
    @app.get("/get_server_info")  # SGLang's deprecated alias
    async def server_info() -> dict:
        version = service.engine.weight_version if service.ready else service.initial_version
        return {**service.server_args, "model_path": service.model_path,
                "tokenizer_path": service.tokenizer_path, "weight_version": version,
                "version": SERVER_VERSION,
                "internal_states": [{"paused": service.paused, "in_flight": len(service.requests),
                                     "weights_incomplete": service.weights_incomplete}]}

    @app.get("/get_weights_checksum")  # not SGLang: lets tests verify weights over HTTP
    async def weights_checksum() -> dict:
        return {"sha256": await run_in_threadpool(service.weights_sha256)}


def _batch_size_error(body: Any, limit: int) -> str | None:
    """Why a /generate batch is over the server's limit, counted before anything reads it whole."""
    if not isinstance(body, dict):
        return None  # the validation's to refuse
    for key in ("input_ids", "text"):
        value = body.get(key)
        if isinstance(value, list) and value and (key == "text" or isinstance(value[0], list)) and len(value) > limit:
            return f"{len(value)} prompts in one request; this server takes at most {limit} (max_prompts_per_request)"
    return None


def _prompts(obj: GenerateReqInput, tokenizer: Any) -> tuple[list[list[int]], bool]:
    """Token-id prompts of a /generate body, and whether it was a single (non-batch) request."""
    if obj.input_ids is not None:
        ids = obj.input_ids
        single = not ids or not isinstance(ids[0], list)
        prompts = [ids] if single else ids
    elif obj.text is not None:
        single = isinstance(obj.text, str)
        texts = [obj.text] if single else obj.text
        prompts = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    else:
        raise ValueError("a /generate request needs input_ids or text")
    if not prompts:
        raise ValueError("a /generate request needs at least one prompt")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("empty prompt")
    return prompts, single


def _rids(rid: str | list[str] | None, n: int) -> list[str]:
    if rid is None:
        return [uuid.uuid4().hex for _ in range(n)]
    rids = [rid] if isinstance(rid, str) else list(rid)
    if len(rids) != n:
        raise ValueError(f"{len(rids)} rids for {n} prompts")
    return rids


async def _abort_when_client_leaves(request: Request, req: InFlight) -> None:
    """Aborts a request whose client went away, as SGLang does: no one would read its answer.
    The body was read, so the next message is the disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    req.aborted.set()


def _add_generate_routes(app: FastAPI, service: EngineService, limits: ServerLimits) -> None:
    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request):
        started = time.perf_counter()
        body = await _json(request)
        if too_many := _batch_size_error(body, limits.max_prompts_per_request):
            return _error(400, too_many)
        obj = _validated(GenerateReqInput, body)
        if service.weights_incomplete is not None:  # at once, not after waiting its turn
            return _error(503, f"the engine holds no complete weight version: {service.weights_incomplete}")
        try:  # tokenizing a batch of texts must not hold the event loop (health, abort)
            prompts, single = await run_in_threadpool(_prompts, obj, service.engine.tokenizer)
            rids = _rids(obj.rid, len(prompts))
            adapter = await run_in_threadpool(service.lora.acquire, obj.lora_path, service.weight_shapes)
        except ValueError as exc:
            return _error(400, str(exc))
        req = service.register(rids)
        req.adapter = adapter
        watcher = asyncio.create_task(_abort_when_client_leaves(request, req))
        try:
            await service.wait_unpaused(req)
            outs = await asyncio.get_running_loop().run_in_executor(service.generation_thread, service.generate,
                                                                    req, prompts, body)
        except EngineUnavailable as exc:
            return _error(503, str(exc))
        except (ValueError, TypeError) as exc:  # bad sampling params: the caller's error
            return _error(400, f"{type(exc).__name__}: {exc}")
        finally:
            watcher.cancel()
            service.unregister(req)
            await run_in_threadpool(service.lora.release, adapter)
        for out, rid in zip(outs, rids):
            out["meta_info"].update(id=rid, cached_tokens=0, e2e_latency=time.perf_counter() - started)
        return outs[0] if single else outs


def _add_control_routes(app: FastAPI, service: EngineService) -> None:
    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        obj = await _parse(request, AbortReq)
        if obj.abort_all:
            service.abort()
        elif obj.rid:  # SGLang ignores an abort that names no request
            service.abort(obj.rid)
        return Response(status_code=200)

    @app.post("/pause_generation")
    async def pause_generation(request: Request):
        service.pause((await _parse(request, PauseGenerationReqInput)).mode)
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def continue_generation(request: Request) -> dict:
        await _parse(request, ContinueGenerationReqInput)
        service.resume()
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        # No call reuses another's keys and values (each prefill overwrites its slots); refuse
        # only while a batch runs, like SGLang. A flush does not complete a partial weight update.
        if service.current is not None:
            return Response("Cache not flushed: requests are running.\n", status_code=400)
        service.stale_cache_version = None
        return Response("Cache flushed.\n", status_code=200)

    @app.api_route("/release_memory_occupation", methods=["GET", "POST"])
    async def release_memory_occupation(request: Request) -> dict:
        tags = (await _parse(request, MemoryOccupationReqInput)).tags
        return await run_in_threadpool(service.release_memory, tags)  # waits for the running batch

    @app.api_route("/resume_memory_occupation", methods=["GET", "POST"])
    async def resume_memory_occupation(request: Request) -> dict:
        tags = (await _parse(request, MemoryOccupationReqInput)).tags
        return await run_in_threadpool(service.resume_memory, tags)


def _weights_response(result: dict) -> JSONResponse:
    return JSONResponse(result, status_code=200 if result["success"] else 400)


def _weight_route(service: EngineService, fn, model: type[SGLangStruct]):
    """An endpoint validating its body as `model`, then running `fn(body)` in a worker thread (it
    may block on the generation lock or on a broadcast) and answering {"success", "message"}:
    200 on success, else 400."""

    async def endpoint(request: Request) -> JSONResponse:
        body = (await _parse(request, model)).model_dump()
        if body.get("abort_all_requests"):
            service.abort()
        try:
            return _weights_response(await run_in_threadpool(fn, body))
        except Exception as exc:  # a bad request must answer, not kill the server
            logger.exception("%s failed", request.url.path)
            return _weights_response(weight_result(False, f"{type(exc).__name__}: {exc}"))

    return endpoint


def _lora_route(fn, model: type[SGLangStruct]):
    """SGLang's LoRA routes: the body validated as `model`, `fn(body)` in a worker thread (an
    unload waits for the requests using the adapter), its LoRAUpdateOutput answered 200 on
    success, else 400."""

    async def endpoint(request: Request) -> JSONResponse:
        result = await run_in_threadpool(fn, (await _parse(request, model)).model_dump())
        return JSONResponse(result, status_code=200 if result["success"] else 400)

    return endpoint


def _add_weight_routes(app: FastAPI, service: EngineService) -> None:
    for path, fn, model in [
            ("/update_weights_from_disk", service.update_from_disk, UpdateWeightFromDiskReqInput),
            ("/init_weights_update_group", service.init_group, InitWeightsUpdateGroupReqInput),
            ("/update_weights_from_distributed", service.update_from_distributed, UpdateWeightsFromDistributedReqInput),
            ("/destroy_weights_update_group", service.destroy_group, DestroyWeightsUpdateGroupReqInput),
            ("/begin_weight_update", service.begin_weight_update, BeginWeightUpdateReqInput),
            ("/end_weight_update", service.end_weight_update, EndWeightUpdateReqInput)]:
        app.add_api_route(path, _weight_route(service, fn, model), methods=["POST"])

    for path, fn, model in [("/load_lora_adapter", service.load_lora_adapter, LoadLoRAAdapterReqInput),
                            ("/unload_lora_adapter", service.unload_lora_adapter, UnloadLoRAAdapterReqInput)]:
        app.add_api_route(path, _lora_route(fn, model), methods=["POST"])

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request) -> JSONResponse:
        obj = await _parse(request, UpdateWeightVersionReqInput)
        if obj.abort_all_requests:
            service.abort()
        service.engine.weight_version = obj.new_version
        return JSONResponse({**weight_result(True, f"Weight version updated to {obj.new_version}"),
                             "new_version": obj.new_version})


class ServerHandle:
    """A running server (a RolloutEngine, see interface.py): `.url`, `.engine`,
    `.wait_ready()`, `.stop()`."""

    def __init__(self, service: EngineService, server: uvicorn.Server, thread: threading.Thread,
                 host: str, port: int):
        self.service, self._server, self._thread = service, server, thread
        self.host, self.port = host, port
        self.url = f"http://{host}:{port}"
        self.shared: SharedWeights | None = None
        self._shared_pairs: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        """(live tensors, buffer views) of the mapped buffer, resolved once at mapping."""

    @property
    def engine(self) -> EmbeddedEngine | None:
        return self.service.engine

    def load_model(self) -> None:
        threading.Thread(target=self.service.load, name="engine-load", daemon=True).start()

    def wait_ready(self, timeout: float = 120.0) -> None:
        if not self.service.loaded.wait(timeout):
            raise TimeoutError(f"model not loaded after {timeout} s")
        if self.service.load_error is not None:
            raise RuntimeError(f"model failed to load: {self.service.load_error}")

    def update_weights_from_tensors(self, named_tensors: dict[str, torch.Tensor], weight_version: str) -> dict:
        """In-process tensors (the object-store transport), loaded under the engine lock so that
        a generation in progress finishes on the old weights."""
        with self.service.lock:
            result = self.service.load_tensors(named_tensors, weight_version, checkpoint_names_only=False)
        # What this sync moved (weights/sync_bytes); in-process only, so SGLang's HTTP answers keep their shape.
        return {**result, "received_bytes": payload_bytes(named_tensors)}

    def map_shared_weights(self, handle: BufferHandle) -> dict:
        """Map the trainer's shared weight buffer (the shared-memory transport) and resolve,
        once, which live tensor each of its views loads into."""
        shared = SharedWeights.open(handle)
        with self.service.lock:
            targets = self.service.resolve_targets(shared.views, checkpoint_names_only=False)
        if isinstance(targets, str):
            return weight_result(False, targets)
        self.shared, self._shared_pairs = shared, (targets, list(shared.views.values()))
        return weight_result(True, f"mapped {len(shared.views)} shared tensors")

    def load_shared_weights(self, weight_version: str) -> dict:
        """Copy the mapped buffer into the model, under the engine lock like any update."""
        if self.shared is None:
            return weight_result(False, "no shared weight buffer mapped; call map_shared_weights first")
        with self.service.lock:
            result = self.service.copy_into(*self._shared_pairs, weight_version)
            if self.shared.flat.is_cuda:  # the trainer's next write must not race this copy
                torch.cuda.current_stream().synchronize()
            return result

    def weights_sha256(self) -> str:
        return self.service.weights_sha256()

    def stop(self, timeout: float = 10.0) -> None:
        self.service.abort()  # so a running batch ends and the graceful shutdown is quick
        self._server.should_exit = True
        self._thread.join(timeout)
        self.service.generation_thread.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> ServerHandle:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def serve(model_dir: str | Path, host: str = "127.0.0.1", port: int = 0, *, tokenizer_path: str | None = None,
          server_args: dict | None = None, dtype: str = "float32", num_threads: int | None = None,
          weight_version: str | None = None, load: bool = True, wait_ready: bool = True,
          log_level: str = "warning", start_timeout: float = 30.0, api_key: str | None = None,
          limits: ServerLimits | None = None) -> ServerHandle:
    """Start the server in a background thread. port=0 picks a free port (see `.url`).
    With load=False the HTTP side is up (health answers 503) until `.load_model()`. With an
    api_key every route but the health probes needs it (as SGLang's --api-key). limits: what one
    client may ask (ServerLimits' defaults)."""
    service = EngineService(str(model_dir), tokenizer_path, server_args, dtype, num_threads, weight_version,
                            api_key=api_key)
    limits = limits or ServerLimits()
    # Binding here, not inside uvicorn, is what makes port=0 usable: we know the port at once.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    # h11 pinned (uvicorn's "auto" would take httptools where installed): the read deadline is ours.
    config = uvicorn.Config(create_app(service, limits), log_level=log_level, lifespan="off",
                            timeout_graceful_shutdown=2, access_log=False, ws="none",
                            http=timed_protocol(limits.request_read_timeout))
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"HTTP server on {host}:{port} did not start")
        time.sleep(0.01)
    handle = ServerHandle(service, server, thread, host, sock.getsockname()[1])
    if load:
        handle.load_model()
        if wait_ready:
            handle.wait_ready()
    return handle


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The sglang.launch_server flags a recipe may set (miles_core.engines.sglang.args): ours are
    honoured or accepted. Anything else exits with an error at start, as SGLang does."""
    # No abbreviations: a prefix SGLang would resolve (or reject as ambiguous) is never meant.
    parser = argparse.ArgumentParser(prog="python -m miles_core.engines.embedded.http_server", allow_abbrev=False)
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--api-key")
    # The embedded server's own bounds (SGLang has none of these); unset: ServerLimits' defaults.
    parser.add_argument("--max-request-bytes", type=int)
    parser.add_argument("--max-prompts-per-request", type=int)
    parser.add_argument("--request-read-timeout", type=float)
    for key, is_flag in SERVER_ARGS.items():
        kind = {"action": "store_true"} if is_flag else {"nargs": "*"} if key in LIST_ARGS else {}
        parser.add_argument("--" + key.replace("_", "-"), **kind)
    args = parser.parse_args(argv)
    if int(args.tp_size or 1) != 1:  # it would join a weight-update group with one rank, not tp_size
        parser.error("--tp-size: the embedded engine runs one rank; use 1")
    return args


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    if args.random_seed is not None:
        torch.manual_seed(int(args.random_seed))
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    ours = {"max_request_bytes", "max_prompts_per_request", "request_read_timeout"}
    limits = ServerLimits(**{k: getattr(args, k) for k in ours if getattr(args, k) is not None})
    server_args = {k: v for k, v in vars(args).items() if v not in (None, False) and k not in ours | {"api_key"}}
    handle = serve(args.model_path, args.host, args.port, tokenizer_path=args.tokenizer_path,
                   server_args=server_args, dtype=args.dtype or "float32", weight_version=args.weight_version,
                   api_key=args.api_key, limits=limits,
                   wait_ready=False, log_level=(args.log_level or "info").lower())
    logger.info("serving %s at %s", args.model_path, handle.url)
    stop.wait()
    handle.stop()
    logging.shutdown()
    # Tearing down torch/transformers at interpreter exit takes seconds and does nothing useful
    # for a server that has already shut down cleanly.
    os._exit(0)


if __name__ == "__main__":
    main()
