"""Client and launcher for SGLang's native HTTP API (the subset an RL trainer needs).

`SGLangClient` speaks to a real `sglang.launch_server` or to our embedded stand-in
(`miles_core.engines.embedded.http_server`); both answer the same wire protocol, so CI exercises
this exact code without SGLang installed. `SGLangLauncher` starts either as a subprocess.
SGLang itself is never imported here: it pins a CUDA torch that CPU machines cannot install.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import requests

from miles_core.engines.sglang.args import server_arg_flags
from miles_core.errors import InfrastructureError
from miles_core.net import free_port

logger = logging.getLogger(__name__)

RETRY_STATUSES = {500, 502, 503, 504}
# Sent with every weight update, whatever SGLang's defaults are: the prefix (radix) cache holds
# KV computed with the old weights, and running requests finish rather than being aborted.
WEIGHT_UPDATE_DEFAULTS = {"flush_cache": True, "abort_all_requests": False}
IN_PROCESS_WEIGHTS_REFUSED = ("an SGLang engine runs in its own process: its weights move over HTTP "
                              "(rollout.weight_transport=broadcast, cuda_ipc or disk)")


class EngineError(InfrastructureError):
    """A failed call to a rollout engine. `status` is None when no HTTP answer came back
    (connection refused, timeout): the case a router treats as a dead engine."""

    def __init__(self, message: str, url: str = "", status: int | None = None):
        super().__init__(f"{message} (url={url}, status={status})")
        self.url = url
        self.status = status


class SGLangClient:
    """Calls one SGLang server. Every call has a timeout; idempotent calls retry on
    connection errors and 5xx with a short backoff."""

    def __init__(self, base_url: str, timeout_seconds: float = 300.0, connect_timeout: float = 5.0,
                 retries: int = 3, backoff_seconds: float = 0.5, api_key: str | None = None):
        """api_key: the engine's key (SGLang's --api-key), sent as a bearer token."""
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout_seconds = timeout_seconds
        self.connect_timeout = connect_timeout
        self.retries = retries
        self.backoff_seconds = backoff_seconds
        # requests.Session is not documented as thread-safe; routers call from many threads.
        self._local = threading.local()

    def __repr__(self) -> str:
        return f"SGLangClient({self.base_url!r})"

    # ---- transport -------------------------------------------------------------------------

    def _session(self) -> requests.Session:
        if not hasattr(self._local, "session"):
            self._local.session = requests.Session()
            if self.api_key:
                self._local.session.headers["Authorization"] = f"Bearer {self.api_key}"
        return self._local.session

    def _call(self, method: str, path: str, payload: dict | None = None, *, idempotent: bool = True,
              timeout: float | None = None, ok_statuses: tuple[int, ...] = ()) -> requests.Response:
        url = self.base_url + path
        attempts = 1 + (self.retries if idempotent else 0)
        for attempt in range(attempts):
            last = attempt == attempts - 1
            try:
                resp = self._session().request(method, url, json=payload,
                                               timeout=(self.connect_timeout, timeout or self.timeout_seconds))
            except (requests.ConnectionError, requests.Timeout) as exc:
                if last:
                    raise EngineError(f"{method} {path} failed: {type(exc).__name__}: {exc}", url) from exc
            else:
                if resp.status_code < 400 or resp.status_code in ok_statuses:
                    return resp
                if resp.status_code not in RETRY_STATUSES or last:
                    raise EngineError(f"{method} {path} returned {_error_text(resp)}", url, resp.status_code)
            time.sleep(self.backoff_seconds * (2 ** attempt))
        raise AssertionError("unreachable")

    def _get_json(self, path: str) -> Any:
        return self._call("GET", path).json()

    def _post_result(self, path: str, payload: dict, timeout: float | None = None) -> dict:
        """POST to a weight/control endpoint answering {"success", "message"}; raise on failure.
        SGLang answers a failed update with 400 and the same body, so 400 is read, not raised."""
        resp = self._call("POST", path, payload, idempotent=False, timeout=timeout, ok_statuses=(400,))
        body = resp.json() if resp.content else {}
        if resp.status_code >= 400 or body.get("success") is False:
            # LoRA routes answer SGLang's LoRAUpdateOutput: its text is `error_message`
            message = body.get("message") or body.get("error_message") or resp.text
            raise EngineError(f"{path} failed: {message}", resp.url, resp.status_code)
        return body

    # ---- generation ------------------------------------------------------------------------

    def generate(self, input_ids: list[int] | list[list[int]], sampling_params: dict[str, Any],
                 return_logprob: bool = True, rid: str | list[str] | None = None,
                 timeout: float | None = None, **extra: Any) -> list[dict[str, Any]]:
        """POST /generate for one prompt or a batch; always returns a list of responses.
        Not retried: a retry could run a request twice (the Router retries on another engine)."""
        payload: dict[str, Any] = {"input_ids": input_ids, "sampling_params": sampling_params,
                                   "return_logprob": return_logprob, **extra}
        if rid is not None:
            payload["rid"] = rid
        out = self._call("POST", "/generate", payload, idempotent=False, timeout=timeout).json()
        return out if isinstance(out, list) else [out]

    def score_prompt(self, input_ids: list[int] | list[list[int]], logprob_start_len: int = 0,
                     timeout: float | None = None) -> list[list[float | None]]:
        """Prefill scoring: per prompt, the logprob of each input token from `logprob_start_len`
        (the first token of a prompt has no context, so its entry is None)."""
        responses = self.generate(input_ids, {"max_new_tokens": 0, "temperature": 0.0},
                                  return_logprob=True, logprob_start_len=logprob_start_len, timeout=timeout)
        return [[entry[0] for entry in r["meta_info"]["input_token_logprobs"]] for r in responses]

    # ---- health and info -------------------------------------------------------------------

    def health(self, timeout: float = 5.0) -> bool:
        """One probe of /health_generate; never raises (a probe must not need a try)."""
        try:
            resp = self._session().get(self.base_url + "/health_generate", timeout=(self.connect_timeout, timeout))
            return resp.status_code == 200
        except requests.RequestException:
            return False

    def wait_healthy(self, timeout_seconds: float = 600.0, process: subprocess.Popen | None = None,
                     interval: float = 2.0, log_path: str | Path | None = None) -> None:
        """Poll until the server answers 200; fail fast if `process` exits meanwhile."""
        deadline = time.monotonic() + timeout_seconds
        while True:
            if process is not None and process.poll() is not None:
                raise EngineError(f"server process exited with code {process.returncode} before it was "
                                  f"healthy{_log_tail(log_path)}", self.base_url)
            # SGLang's /health_generate runs a 1-token generation: give it more than `interval`.
            if self.health(timeout=min(30.0, max(5.0, interval * 5))):
                return
            if time.monotonic() > deadline:
                raise EngineError(f"server not healthy after {timeout_seconds:.0f} s{_log_tail(log_path)}",
                                  self.base_url)
            time.sleep(interval)

    def model_info(self) -> dict[str, Any]:
        # /get_model_info is a deprecated alias in SGLang 0.5.16, 0.5.17 and 0.5.23.
        return self._get_json("/model_info")

    def server_info(self) -> dict[str, Any]:
        return self._get_json("/server_info")

    def weight_version(self) -> str:
        return str(self.model_info().get("weight_version"))

    # ---- control ---------------------------------------------------------------------------

    def pause(self, mode: str = "abort") -> None:
        self._call("POST", "/pause_generation", {"mode": mode})

    def resume(self) -> None:
        self._call("POST", "/continue_generation", {})

    def flush_cache(self, timeout_seconds: float = 60.0, interval: float = 0.5) -> None:
        """SGLang refuses (400) while requests run; that is transient, so retry until timeout."""
        deadline = time.monotonic() + timeout_seconds
        while True:
            resp = self._call("POST", "/flush_cache", {}, ok_statuses=(400,))
            if resp.status_code == 200:
                return
            if time.monotonic() > deadline:
                raise EngineError("flush_cache still refused (requests pending)", resp.url, resp.status_code)
            time.sleep(interval)

    def abort(self, rid: str | None = None) -> None:
        """Abort one request by rid, or every request when rid is None."""
        self._call("POST", "/abort_request", {"rid": rid} if rid is not None else {"abort_all": True})

    def release_memory(self, tags: list[str] | None = None) -> None:
        self._call("POST", "/release_memory_occupation", {"tags": tags}, idempotent=False)

    def resume_memory(self, tags: list[str] | None = None) -> None:
        self._call("POST", "/resume_memory_occupation", {"tags": tags}, idempotent=False)

    # ---- weights ---------------------------------------------------------------------------

    def update_weights_from_disk(self, model_path: str, weight_version: str | None = None,
                                 load_format: str | None = None, timeout_seconds: float = 3600.0) -> dict:
        """SGLang keeps loading after a client gives up, so the timeout is the load's own
        (minutes for a large model), not the generate timeout."""
        payload: dict[str, Any] = {"model_path": str(model_path), **WEIGHT_UPDATE_DEFAULTS}
        if weight_version is not None:
            payload["weight_version"] = str(weight_version)
        if load_format is not None:
            payload["load_format"] = load_format
        return self._post_result("/update_weights_from_disk", payload, timeout=timeout_seconds)

    @contextlib.contextmanager
    def weight_update_session(self, selector: str = "all") -> Iterator[None]:
        """SGLang 0.5.23 loads distributed and tensor weight updates only inside a session
        (/begin_weight_update ... /end_weight_update) and refuses them outside one; older servers
        have no such routes (404) and need none. A session left open by a sender that died
        mid-update is closed and opened again."""
        opened, message = self._begin_weight_update(selector)
        if opened is False and "already open" in message:
            logger.warning("%s: a weight-update session was left open; closing it first", self.base_url)
            self._post_result("/end_weight_update", {})
            opened, message = self._begin_weight_update(selector)
        if opened is False:
            raise EngineError(f"/begin_weight_update failed: {message}", self.base_url, 400)
        try:
            yield
        except BaseException:
            if opened:  # closed for the next attempt; the update's own error is the one raised
                with contextlib.suppress(EngineError):
                    self._post_result("/end_weight_update", {})
            raise
        if opened:
            self._post_result("/end_weight_update", {})

    def _begin_weight_update(self, selector: str) -> tuple[bool | None, str]:
        """(True: opened, None: the server has no sessions (SGLang before 0.5.23), False:
        refused; the server's message)."""
        resp = self._call("POST", "/begin_weight_update", {"selector": selector}, idempotent=False,
                          ok_statuses=(400, 404))
        if resp.status_code == 404:
            return None, ""
        body = resp.json() if resp.content else {}
        return resp.status_code < 400 and body.get("success") is not False, str(body.get("message", resp.text))

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str, backend: str = "nccl") -> dict:
        return self._post_result("/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend})

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        group_name: str, weight_version: str | None = None,
                                        flush_cache: bool = True) -> dict:
        """Blocks until the server has received every tensor: call it from a thread while the
        trainer broadcasts the same tensors, in the same order, from rank 0. Inside a
        `weight_update_session` (SGLang 0.5.23 refuses it outside one)."""
        payload: dict[str, Any] = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
                                   **WEIGHT_UPDATE_DEFAULTS, "flush_cache": flush_cache}
        if weight_version is not None:
            payload["weight_version"] = str(weight_version)
        return self._post_result("/update_weights_from_distributed", payload)

    def update_weights_from_ipc_handles(self, payloads: list[str], weight_version: str | None = None,
                                        flush_cache: bool = True) -> dict:
        """POST /update_weights_from_tensor in SGLang's flattened-bucket format: one base64 payload
        per TP rank (miles_core.weight_sync.cuda_ipc.serialize_bucket), each CUDA IPC handles to a buffer on
        that rank's GPU. Inside a `weight_update_session` (SGLang 0.5.23 refuses it outside one)."""
        payload: dict[str, Any] = {"serialized_named_tensors": payloads, "load_format": "flattened_bucket",
                                   **WEIGHT_UPDATE_DEFAULTS, "flush_cache": flush_cache}
        if weight_version is not None:
            payload["weight_version"] = str(weight_version)
        return self._post_result("/update_weights_from_tensor", payload)

    def destroy_weights_update_group(self, group_name: str) -> dict:
        return self._post_result("/destroy_weights_update_group", {"group_name": group_name})

    def load_lora_adapter(self, name: str, path: str, timeout_seconds: float = 600.0) -> dict:
        """POST /load_lora_adapter: the PEFT folder at `path` (on the engine's disk) is served as
        `name`, which a /generate names in `lora_path`. SGLang refuses (400, `error_message`) a
        name already loaded, a rank over --max-lora-rank or modules outside --lora-target-modules.
        The timeout is the load's own, as for update_weights_from_disk."""
        return self._post_result("/load_lora_adapter", {"lora_name": name, "lora_path": str(path)},
                                 timeout=timeout_seconds)

    def unload_lora_adapter(self, name: str, timeout_seconds: float = 600.0) -> dict:
        """POST /unload_lora_adapter. SGLang stops admitting requests naming it at once and
        unloads it once those already admitted have finished (the call waits for them)."""
        return self._post_result("/unload_lora_adapter", {"lora_name": name}, timeout=timeout_seconds)

    def update_weight_version(self, new_version: str, abort_all_requests: bool = False) -> dict:
        return self._post_result("/update_weight_version", {"new_version": str(new_version),
                                                            "abort_all_requests": abort_all_requests})


def _error_text(resp: requests.Response) -> str:
    return f"HTTP {resp.status_code}: {resp.text[:500]}"


def _log_tail(log_path: str | Path | None, lines: int = 30) -> str:
    if not log_path or not Path(log_path).exists():
        return ""
    tail = Path(log_path).read_text(errors="replace").splitlines()[-lines:]
    return "\n--- server log tail ---\n" + "\n".join(tail)


class SGLangLauncher:
    """Starts `python -m <module> --model-path ... --host ... --port ...` in its own session
    (so stop() can end the server and every child it spawned) and waits until it is healthy.
    `module` defaults to SGLang; tests pass `miles_core.engines.embedded.http_server`.

    A RolloutEngine (see interface.py) whose weights only move over HTTP."""

    def __init__(self, model_path: str | Path, server_args: dict[str, Any] | None = None,
                 host: str = "127.0.0.1", port: int | None = None, module: str = "sglang.launch_server",
                 api_key: str | None = None,
                 python: str = sys.executable, log_path: str | Path | None = None,
                 env: dict[str, str] | None = None, startup_timeout: float = 900.0,
                 poll_interval: float = 2.0):
        self.model_path = str(model_path)
        self.server_args = dict(server_args or {})
        self.api_key = api_key
        self.host = host
        self.port = port or free_port(host)
        self.module = module
        self.python = python
        self.log_path = Path(log_path) if log_path else Path(f"/tmp/sglang-{self.port}.log")
        self.env = env
        self.startup_timeout = startup_timeout
        self.poll_interval = poll_interval
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        # SGLang takes its key only as a flag: it is visible to users of this node (`ps`), never
        # to the network. It changes per engine group, so a leaked one dies with the run. Joined
        # with `=`: argparse would take a key that starts with "-" for the next flag.
        key = [f"--api-key={self.api_key}"] if self.api_key else []
        return [self.python, "-m", self.module, "--model-path", self.model_path,
                "--host", self.host, "--port", str(self.port), *key, *server_arg_flags(self.server_args)]

    def start(self, wait: bool = True, **client_kwargs: Any) -> SGLangClient:
        cmd = self.command()
        shown = ["--api-key=<api key>" if arg.startswith("--api-key=") else arg for arg in cmd]
        logger.info("launching engine: %s (log %s)", " ".join(shown), self.log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                            env={**os.environ, **(self.env or {})}, preexec_fn=_die_with_parent)
        client = SGLangClient(self.url, api_key=self.api_key, **client_kwargs)
        if wait:
            try:
                client.wait_healthy(self.startup_timeout, process=self.process,
                                    interval=self.poll_interval, log_path=self.log_path)
            except Exception:
                self.stop()
                raise
        return client

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM the server's process group; SIGKILL what is left (a hung leader, or children
        that outlived it) so that no engine process survives stop()."""
        proc, self.process = self.process, None
        if proc is None:
            return
        _signal_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            logger.warning("engine pid %d ignored SIGTERM for %.0f s; killing it", proc.pid, timeout)
        _signal_group(proc.pid, signal.SIGKILL)
        proc.wait(timeout=timeout)

    def update_weights_from_tensors(self, named_tensors: dict, weight_version: str) -> dict:
        raise NotImplementedError(IN_PROCESS_WEIGHTS_REFUSED)

    def map_shared_weights(self, handle: Any) -> dict:
        raise NotImplementedError(IN_PROCESS_WEIGHTS_REFUSED)

    def load_shared_weights(self, weight_version: str) -> dict:
        raise NotImplementedError(IN_PROCESS_WEIGHTS_REFUSED)

    def weights_sha256(self) -> str:
        raise NotImplementedError("SGLang has no endpoint for a digest of its weights: "
                                  "rollout.verify_weight_sync needs embedded engines")


def _die_with_parent() -> None:
    """In the server's process, before exec: SIGTERM it when the process that launched it dies
    (an engine actor killed by Ray runs no shutdown hook), so its GPU is freed; SGLang ends
    its own children on SIGTERM."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:  # the group is already empty
        pass
