"""The embedded engine's HTTP server under abuse (issue 44): malformed bodies, oversize bodies,
huge batches, aborts of long work, slow clients and interrupted weight updates. Each answer is
SGLang's (a 4xx in its error shape) or a bound SGLang does not set (ServerLimits); none is a
500, a stall, or a generation on weights of no version."""

from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
import torch
from safetensors.torch import load_file

from miles_core.config import TinyModelConfig
from miles_core.engines.embedded.http_limits import ServerLimits
from miles_core.engines.embedded.http_server import serve
from miles_core.engines.sglang.client import EngineError, SGLangClient
from miles_core.net import free_port
from miles_core.rollout.router import Router
from miles_core.tiny import build_tiny_model
from miles_core.weight_sync.layout import weights_sha256

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    handle = serve(tiny_model_dir, num_threads=1)
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    """Other random weights of the tiny model: the 'trained' weights to push."""
    return build_tiny_model(TinyModelConfig(seed=1), tmp_path_factory.mktemp("target") / "model")


def _post(url: str, body: bytes, content_type: str = "application/json") -> requests.Response:
    return requests.post(url, data=body, headers={"Content-Type": content_type}, timeout=30)


# ---- malformed bodies: 400 in SGLang's shape, on every route ---------------------------------------

DEEP = b"[" * 100_000 + b"]" * 100_000
MALFORMED = {  # bodies no route takes
    "truncated": b'{"rid": ',
    "array": b"[]",
    "string": b'"abort"',
    "number": b"5",
    "null": b"null",
    "empty": b"",
    "invalid utf-8": b'{"rid": "\xff\xfe"}',
    "utf-16 garbage": b"\xff\xfe{\x00",
    "deep nesting": DEEP,
    "deep nesting in a field": b'{"rid": ' + DEEP + b', "input_ids": ' + DEEP + b"}",
    "5000-digit number": b'{"rid": ' + b"9" * 5000 + b"}",
}
ROUTE_BODIES = {  # per route: bodies of the right JSON shape with a wrong or extreme value
    "/generate": [b'{"input_ids": [5, 6], "return_logprob": true, "logprob_start_len": 1e999}',
                  b'{"input_ids": [5, 6], "return_logprob": true, "logprob_start_len": Infinity}',
                  b'{"input_ids": [5, 6], "sampling_params": {"temperature": NaN}}',
                  b'{"input_ids": [5, 6], "sampling_params": {"max_new_tokens": -1}}',
                  b'{"input_ids": [5, 1e999]}', b'{"input_ids": [[5], "6"]}', b'{"input_ids": [5, true]}',
                  b'{"input_ids": [5, 99999999999999999999]}', b'{"text": 5}', b'{"rid": 5, "input_ids": [5]}',
                  b'{"input_ids": [5], "sampling_params": [5]}', b'{"input_ids": [5], "return_logprob": "yes"}'],
    "/abort_request": [b'{"rid": 5}', b'{"abort_all": "maybe"}', b'{"rid": ["a", "b"]}'],
    "/pause_generation": [b'{"mode": 5}', b'{"mode": "pause"}', b'{"mode": null}'],
    "/continue_generation": [b'{"torch_empty_cache": []}'],
    "/update_weight_version": [b"{}", b'{"new_version": 5}', b'{"new_version": null}',
                               b'{"new_version": "1", "abort_all_requests": {}}'],
    "/update_weights_from_disk": [b"{}", b'{"model_path": 1e999}'],
    "/init_weights_update_group": [b'{"master_address": "127.0.0.1", "master_port": Infinity, '
                                   b'"rank_offset": 1, "world_size": 2}'],
    "/update_weights_from_distributed": [b'{"names": ["a"], "dtypes": ["float32"], "shapes": [[1e999]]}',
                                         b'{"names": "a", "dtypes": [], "shapes": []}'],
    "/destroy_weights_update_group": [b'{"group_name": []}'],
    "/begin_weight_update": [b'{"selector": "both"}'],
}


def test_malformed_bodies_are_400_in_sglangs_shape_on_every_route(server):
    """SGLang validates each body (FastAPI + pydantic, then 0.5.23's JSON contract for /generate)
    and answers 400, as {"object": "error", "message", ...} or {"error": {"message"}}."""
    cases = [(route, body) for route in ROUTE_BODIES for body in MALFORMED.values()]
    cases += [(route, body) for route, bodies in ROUTE_BODIES.items() for body in bodies]
    cases += [(route, b'{"mode": "abort"}', "text/plain") for route in ("/pause_generation", "/generate")]
    wrong = {}
    for route, body, *content_type in cases:
        resp = _post(server.url + route, body, *content_type)
        payload = resp.json() if resp.headers.get("content-type") == "application/json" else None
        payload = payload if isinstance(payload, dict) else {}
        message = payload.get("message") or (payload.get("error") or {}).get("message")
        if resp.status_code != 400 or not message:
            wrong[(route, body[:60])] = (resp.status_code, resp.text[:200])
    assert not wrong, f"{len(wrong)} of {len(cases)} not a 400 in SGLang's shape: {wrong}"
    assert requests.get(server.url + "/health", timeout=5).status_code == 200
    assert SGLangClient(server.url).generate([5, 6], {"max_new_tokens": 2})[0]["meta_info"]["finish_reason"]


def test_an_abort_naming_no_request_aborts_nothing(server):
    """SGLang's AbortReq defaults: no rid and abort_all false is a no-op, not abort-all."""
    client = SGLangClient(server.url, timeout_seconds=30, retries=0)
    client.pause("in_place")
    try:
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(client.generate, [5, 6], {"max_new_tokens": 2})
            _wait_for(lambda: len(server.service.requests) == 1)
            assert _post(server.url + "/abort_request", b"{}").status_code == 200
            client.resume()
            assert pending.result(timeout=30)[0]["meta_info"]["finish_reason"]["type"] != "abort"
    finally:
        client.resume()


# ---- oversize bodies: 413 before they are read --------------------------------------------------

def _head(path: str, headers: dict[str, str]) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: engine", *[f"{k}: {v}" for k, v in headers.items()], "", ""]
    return "\r\n".join(lines).encode()


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def _read_until(sock: socket.socket, marker: bytes) -> bytes:
    data = b""
    while marker not in data and (chunk := sock.recv(65536)):
        data += chunk
    return data


def _peak_rss_reset() -> bool:
    try:  # Linux: "5" resets the peak resident set size (VmHWM) of this process
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _peak_rss_mb() -> float:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmHWM"))
    return int(line.split()[1]) / 1024


def _stream_until_answered(sock: socket.socket, total: int) -> tuple[int, bytes]:
    """Sends a chunked body of `total` bytes until the server answers; (bytes sent, answer)."""
    chunk = b"x" * (1 << 20)
    framed = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
    sent = 0
    sock.setblocking(False)
    while sent < total:
        readable, writable, _ = select.select([sock], [sock], [], 10)
        if readable:
            break
        if writable:
            sent += sock.send(framed)
    sock.settimeout(10)
    return sent, sock.recv(65536)


def test_an_oversize_body_is_413_before_it_is_read(tiny_model_dir):
    """A 200 MB body against a 1 MiB limit: refused from its Content-Length without reading it,
    and, sent chunked (no length), once 1 MiB arrived; the server's memory does not grow by it."""
    handle = serve(tiny_model_dir, num_threads=1, limits=ServerLimits(max_request_bytes=1 << 20))
    try:
        tracked = _peak_rss_reset()
        before = _peak_rss_mb()
        with _connect(handle.url) as sock:
            sock.sendall(_head("/generate", {"Content-Type": "application/json", "Content-Length": str(200 << 20)}))
            sock.sendall(b'{"input_ids": [' + b"5, " * 300)
            answer = _read_until(sock, b"max_request_bytes")
        assert answer.startswith(b"HTTP/1.1 413") and b"max_request_bytes" in answer
        with _connect(handle.url) as sock:
            sock.sendall(_head("/generate", {"Content-Type": "application/json", "Transfer-Encoding": "chunked"}))
            sent, answer = _stream_until_answered(sock, 200 << 20)
        assert answer.startswith(b"HTTP/1.1 413")
        assert sent < 32 << 20, f"the server read {sent >> 20} MiB before refusing"
        if tracked:
            assert _peak_rss_mb() - before < 100
        client = SGLangClient(handle.url, timeout_seconds=30, retries=0)
        assert client.generate([5, 6], {"max_new_tokens": 2})  # a body under the limit is served
    finally:
        handle.stop()


def test_the_recipes_server_limits_reach_the_engines_server(tiny_model_dir):
    """rollout.engine's max_request_bytes, max_prompts_per_request and request_read_timeout_seconds
    become the launched server's ServerLimits; unset, they are ServerLimits' defaults."""
    from miles_core.config.rollout import RolloutConfig
    from miles_core.rollout.engine_group import embedded_server_limits, launch_engine

    default = RolloutConfig.model_validate({"engine": "embedded"}).engine
    assert embedded_server_limits(default) == ServerLimits()
    engine = RolloutConfig.model_validate({"engine": {"kind": "embedded", "max_request_bytes": 2048,
                                                      "max_prompts_per_request": 3,
                                                      "request_read_timeout_seconds": 7.5}}).engine
    assert embedded_server_limits(engine) == ServerLimits(2048, 3, 7.5)
    handle = launch_engine(engine, str(tiny_model_dir), "127.0.0.1", "float32", 1, 0, api_key="k")
    try:
        auth = {"Authorization": "Bearer k"}
        big = requests.post(handle.url + "/generate", json={"input_ids": [5] * 1000}, headers=auth, timeout=30)
        assert big.status_code == 413 and "max_request_bytes" in big.text
        many = requests.post(handle.url + "/generate", json={"input_ids": [[5]] * 4}, headers=auth, timeout=30)
        assert many.status_code == 400
        small = requests.post(handle.url + "/generate", headers=auth, timeout=30,
                              json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}})
        assert small.status_code == 200, small.text
    finally:
        handle.stop()
    for field in ("max_request_bytes", "max_prompts_per_request", "request_read_timeout_seconds"):
        with pytest.raises(ValueError, match=f"{field}[\\s\\S]*greater than 0"):
            RolloutConfig.model_validate({"engine": {"kind": "embedded", field: 0}})


# ---- too many prompts ---------------------------------------------------------------------------

def test_a_batch_over_the_prompt_limit_is_400_at_once(server, tiny_model_dir):
    limit = ServerLimits().max_prompts_per_request
    started = time.monotonic()
    for body in ({"input_ids": [[5]] * (limit + 1), "sampling_params": {"max_new_tokens": 1}},
                 {"text": ["1+1="] * (limit + 1), "sampling_params": {"max_new_tokens": 1}}):
        resp = requests.post(server.url + "/generate", json=body, timeout=30)
        assert resp.status_code == 400 and "max_prompts_per_request" in resp.json()["error"]["message"]
    assert time.monotonic() - started < 5
    with serve(tiny_model_dir, num_threads=1, limits=ServerLimits(max_prompts_per_request=4)) as small:
        client = SGLangClient(small.url, timeout_seconds=30, retries=0)
        assert len(client.generate([[5, 6]] * 4, {"max_new_tokens": 1})) == 4
        with pytest.raises(EngineError, match="at most 4") as err:
            client.generate([[5, 6]] * 5, {"max_new_tokens": 1})
        assert err.value.status == 400


# ---- abort stops long work ----------------------------------------------------------------------

def _wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


class SlowForward:
    """Each forward pass of the model takes at least `seconds`: long work on a tiny model."""

    def __init__(self, model: torch.nn.Module, seconds: float):
        self.seconds = seconds
        self.calls = 0
        self._hook = model.register_forward_pre_hook(self._sleep)

    def _sleep(self, module, args):
        self.calls += 1
        time.sleep(self.seconds)

    def close(self) -> None:
        self._hook.remove()


@pytest.mark.parametrize("work", ["decode", "prefill scoring"])
def test_abort_all_ends_a_long_batch_within_seconds(tiny_model_dir, work):
    """300 prompts decoded one at a time (--max-running-requests 1) at 30 ms a forward pass is
    tens of seconds of work; abort_all ends it, and a request queued behind it, in a few."""
    handle = serve(tiny_model_dir, num_threads=1, server_args={"max_running_requests": 1})
    slow = SlowForward(handle.engine.model, 0.03)
    client = SGLangClient(handle.url, timeout_seconds=120, retries=0)
    extra = {"max_new_tokens": 8} if work == "decode" else {"max_new_tokens": 0}
    try:
        with ThreadPoolExecutor(2) as pool:
            batch = pool.submit(client.generate, [[5, 6, 7]] * 300, {"temperature": 0.0, **extra}, True, None,
                                logprob_start_len=0 if work != "decode" else None)
            _wait_for(lambda: slow.calls > 0)
            queued = pool.submit(client.generate, [8, 9], {"max_new_tokens": 8})
            _wait_for(lambda: len(handle.service.requests) == 2)
            started = time.monotonic()
            client.abort()
            outs, [waited] = batch.result(timeout=120), queued.result(timeout=120)
            took = time.monotonic() - started
    finally:
        slow.close()
        handle.stop()
    assert took < 3, f"abort_all took {took:.1f} s to end the batch"
    assert {o["meta_info"]["finish_reason"]["type"] for o in outs} == {"abort"}
    assert waited["meta_info"]["finish_reason"]["type"] == "abort"


def test_a_client_that_gives_up_aborts_its_request(tiny_model_dir):
    """SGLang aborts a request whose client disconnected: no one reads its answer."""
    handle = serve(tiny_model_dir, num_threads=1, server_args={"max_running_requests": 1})
    slow = SlowForward(handle.engine.model, 0.03)
    try:
        impatient = SGLangClient(handle.url, timeout_seconds=1, retries=0)
        with pytest.raises(EngineError, match="Timeout"):
            impatient.generate([[5, 6, 7]] * 300, {"max_new_tokens": 8, "temperature": 0.0})
        _wait_for(lambda: handle.service.current is None and not handle.service.requests, timeout=3)
    finally:
        slow.close()
        handle.stop()


# ---- slow clients -------------------------------------------------------------------------------

def _closed_within(sock: socket.socket, seconds: float, trickle: bytes = b"") -> bool:
    """Whether the server closes the connection within `seconds`, while we send `trickle` a byte
    at a time, every 0.1 s."""
    deadline = time.monotonic() + seconds
    sock.setblocking(False)
    for byte in [trickle[i : i + 1] for i in range(len(trickle))] or [b""] * int(seconds * 10):
        if time.monotonic() > deadline:
            return False
        readable, _, _ = select.select([sock], [], [], 0.1)
        try:
            if readable and sock.recv(65536) in (b"",):
                return True
            if byte:
                sock.send(byte)
        except (ConnectionResetError, BrokenPipeError):
            return True
    return False


def test_slow_clients_are_disconnected_and_slow_work_is_not(tiny_model_dir):
    """A client that trickles its headers or its body, or connects and sends nothing, is cut off
    after request_read_timeout (uvicorn has no such deadline); an oversized head is refused at
    once; a request received whole runs past the deadline."""
    handle = serve(tiny_model_dir, num_threads=1, limits=ServerLimits(request_read_timeout=1.0))
    try:
        head = b"POST /generate HTTP/1.1\r\nHost: engine\r\n"
        with _connect(handle.url) as slowloris, _connect(handle.url) as slow_body, _connect(handle.url) as idle:
            slowloris.sendall(head)
            slow_body.sendall(head + b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
            started = time.monotonic()
            assert _closed_within(slowloris, 4, trickle=b"X-Slow: " + b"a" * 200)
            assert _closed_within(slow_body, 4, trickle=b'"input_ids": [5' + b" " * 200)
            assert _closed_within(idle, 4)
            assert time.monotonic() - started < 6
        with _connect(handle.url) as huge_head:  # h11 holds at most 16 KiB of an unfinished head
            huge_head.sendall(head + b"X-Big: " + b"a" * (32 << 10))
            assert _read_until(huge_head, b"\r\n\r\n").startswith(b"HTTP/1.1 400")
        slow = SlowForward(handle.engine.model, 0.3)  # 2.4 s of generation, past the 1 s deadline
        try:
            [out] = SGLangClient(handle.url, timeout_seconds=30, retries=0).generate([5, 6], {
                "max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True})
        finally:
            slow.close()
        assert len(out["output_ids"]) == 8
    finally:
        handle.stop()


# ---- weight updates: atomic as a client sees them -----------------------------------------------

class FakeSender:
    """The trainer's side of a broadcast, in-process: hands the engine the tensors it `sends`, in
    order, and dies (the receive raises, as gloo's does) after `live_for` of them when told to."""

    def __init__(self):
        self.queue: list[torch.Tensor] = []
        self.live_for: int | None = None

    def sends(self, tensors: list[torch.Tensor], live_for: int | None = None) -> None:
        self.queue, self.live_for = list(tensors), live_for

    def broadcast(self, tensor: torch.Tensor, src: int, group) -> None:
        if self.live_for is not None:
            if self.live_for == 0:
                raise RuntimeError("[gloo] Connection closed by peer")
            self.live_for -= 1
        tensor.copy_(self.queue.pop(0))


def _bucket(tensors: dict[str, torch.Tensor], names: list[str]) -> tuple[list, list, list]:
    return names, [str(tensors[n].dtype).removeprefix("torch.") for n in names], [list(tensors[n].shape) for n in names]


def _health(url: str) -> tuple[int, int]:
    return tuple(requests.get(url + path, timeout=5).status_code for path in ("/health", "/health_generate"))


def _assert_unservable(url: str, version: str) -> None:
    """Health 503, generation refused (503, which routers retry elsewhere), the version unchanged."""
    client = SGLangClient(url, timeout_seconds=30, retries=0)
    assert _health(url) == (503, 503)
    with pytest.raises(EngineError, match="no complete weight version") as err:
        client.generate([5, 6], {"max_new_tokens": 2})
    assert err.value.status == 503
    client.flush_cache()  # what made the mix servable before: it must not now
    assert _health(url) == (503, 503) and client.weight_version() == version


def test_an_interrupted_weight_update_leaves_the_engine_unhealthy_until_a_full_one(tiny_model_dir, target_dir,
                                                                                   monkeypatch):
    tensors = {k: v for file in sorted(target_dir.glob("*.safetensors")) for k, v in load_file(str(file)).items()}
    names = sorted(tensors)
    first, second = names[: len(names) // 2], names[len(names) // 2 :]
    with serve(tiny_model_dir, num_threads=1) as broken, serve(tiny_model_dir, num_threads=1) as healthy:
        client = SGLangClient(broken.url, timeout_seconds=30, retries=0)
        broken.service.groups["g"] = object()
        sender = FakeSender()
        monkeypatch.setattr(torch.distributed, "broadcast", sender.broadcast)
        # 1. the sender is killed between buckets: its session stays open on a mix of weights
        sender.sends([tensors[n] for n in first])
        assert requests.post(broken.url + "/begin_weight_update", json={}, timeout=10).json()["success"]
        client.update_weights_from_distributed(*_bucket(tensors, first), "g", "7", flush_cache=False)
        _assert_unservable(broken.url, "default")
        # 2. the next sender dies one tensor into its last bucket
        sender.sends([tensors[n] for n in first + second], live_for=len(first) + 1)
        with pytest.raises(EngineError, match="Connection closed by peer"), client.weight_update_session():
            client.update_weights_from_distributed(*_bucket(tensors, first), "g", "8", flush_cache=False)
            client.update_weights_from_distributed(*_bucket(tensors, second), "g", "8", flush_cache=True)
        _assert_unservable(broken.url, "default")
        # 3. a router sends nothing to it once its health check fails
        router = Router([client, SGLangClient(healthy.url, timeout_seconds=30, retries=0)])
        assert router.check_health() == {broken.url: False, healthy.url: True}
        for _ in range(4):
            router.generate([5, 6], {"max_new_tokens": 2})
        assert [s["served"] for s in router.stats()] == [0, 4]
        # 4. a complete update makes it whole, at the new version
        sender.sends([tensors[n] for n in first + second])
        with client.weight_update_session():
            client.update_weights_from_distributed(*_bucket(tensors, first), "g", "9", flush_cache=False)
            client.update_weights_from_distributed(*_bucket(tensors, second), "g", "9", flush_cache=True)
        assert _health(broken.url) == (200, 200) and client.weight_version() == "9"
        assert broken.weights_sha256() == weights_sha256(tensors)
        assert client.generate([5, 6], {"max_new_tokens": 2})[0]["meta_info"]["weight_version"] == "9"
        assert router.check_health() == {broken.url: True, healthy.url: True}


GROUP = "killed-sender"
SENDER = f"GROUP = {GROUP!r}\n" + textwrap.dedent("""
    import os, sys
    from datetime import timedelta
    import torch
    from safetensors.torch import load_file
    from miles_core.net import init_custom_process_group
    port, model, killed_after = sys.argv[1], sys.argv[2], int(sys.argv[3])
    tensors = load_file(model)
    group = init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", world_size=2, rank=0, group_name=GROUP,
                                      timeout=timedelta(seconds=60))
    for sent, name in enumerate(sorted(tensors)):
        if sent == killed_after:
            os._exit(1)  # the trainer is killed mid-broadcast
        if sent == len(tensors) // 2:
            sys.stdin.readline()  # the engine loaded the first bucket
        torch.distributed.broadcast(tensors[name].contiguous(), src=0, group=group)
""")


def test_a_trainer_killed_mid_broadcast_leaves_the_engine_unhealthy(tiny_model_dir, target_dir):
    """The real thing over gloo: a sender process that dies halfway through a bucketed update."""
    [model_file] = target_dir.glob("*.safetensors")
    tensors = load_file(str(model_file))
    names = sorted(tensors)
    first, second = names[: len(names) // 2], names[len(names) // 2 :]
    port = free_port()
    sender = subprocess.Popen([sys.executable, "-c", SENDER, str(port), str(model_file), str(len(first) + 2)],
                              stdin=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    with serve(tiny_model_dir, num_threads=1) as handle:
        client = SGLangClient(handle.url, timeout_seconds=60, retries=0)
        try:
            assert client.init_weights_update_group("127.0.0.1", port, 1, 2, GROUP, "gloo")["success"]
            with pytest.raises(EngineError, match="update_weights_from_distributed failed"), \
                    client.weight_update_session():
                client.update_weights_from_distributed(*_bucket(tensors, first), GROUP, "3", flush_cache=False)
                sender.stdin.write(b"go\n")
                sender.stdin.flush()
                client.update_weights_from_distributed(*_bucket(tensors, second), GROUP, "3", flush_cache=True)
        finally:
            sender.wait(timeout=60)
        _assert_unservable(handle.url, "default")
        assert "failed part-way" in client.server_info()["internal_states"][0]["weights_incomplete"]
        assert client.update_weights_from_disk(str(target_dir), weight_version="4")["success"]  # a whole update
        assert _health(handle.url) == (200, 200) and client.weight_version() == "4"


def test_a_weight_update_that_fails_before_touching_the_weights_keeps_the_engine_serving(server, target_dir):
    """A refused or failed update that loaded nothing leaves one complete version: still healthy."""
    client = SGLangClient(server.url, timeout_seconds=30, retries=0)
    version = client.weight_version()
    with pytest.raises(EngineError, match="no \\*.safetensors"):
        client.update_weights_from_disk(str(target_dir.parent), weight_version="5")
    resp = requests.post(server.url + "/update_weights_from_disk", json={"model_path": str(target_dir / "nope")},
                         timeout=10)
    assert resp.status_code == 400
    assert _health(server.url) == (200, 200)
    assert client.generate([5, 6], {"max_new_tokens": 2})[0]["meta_info"]["weight_version"] == version
