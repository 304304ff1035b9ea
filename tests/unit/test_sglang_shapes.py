"""SGLangClient against recorded SGLang request/response shapes, served by a stdlib fake.

The fixtures follow SGLang's native API (python/sglang/srt/entrypoints/http_server.py):
a failed weight update answers 400 with {"success": false, "message": ...}, /abort_request
answers an empty 200, /flush_cache answers 400 while requests are pending.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from miles_core.engines.sglang.args import server_arg_flags
from miles_core.engines.sglang.client import EngineError, SGLangClient, SGLangLauncher
from miles_core.net import free_port

GENERATE_RESPONSE = {
    "text": " 42",
    "output_ids": [17, 9, 1],
    "meta_info": {
        "id": "req-1",
        "finish_reason": {"type": "length", "length": 3},
        "prompt_tokens": 4,
        "completion_tokens": 3,
        "cached_tokens": 0,
        "e2e_latency": 0.12,
        "weight_version": "3",
        "output_token_logprobs": [[-0.5, 17, None], [-1.25, 9, None], [-0.125, 1, None]],
    },
}
BATCH_RESPONSE = [
    GENERATE_RESPONSE,
    {"text": "", "output_ids": [1], "meta_info": {**GENERATE_RESPONSE["meta_info"], "id": "req-2",
                                                "finish_reason": {"type": "stop", "matched": 1},
                                                "completion_tokens": 1,
                                                "output_token_logprobs": [[-0.01, 1, None]]}},
]
SCORE_RESPONSE = {"text": "", "output_ids": [], "meta_info": {
    "finish_reason": {"type": "length", "length": 0}, "prompt_tokens": 3, "completion_tokens": 0,
    "weight_version": "3", "output_token_logprobs": [],
    "input_token_logprobs": [[None, 5, None], [-2.5, 6, None], [-0.75, 7, None]]}}
MODEL_INFO = {"model_path": "/models/qwen3", "tokenizer_path": "/models/qwen3", "is_generation": True,
              "preferred_sampling_params": None, "weight_version": "3"}
UPDATE_FAILED = {"success": False, "message": "Failed to get weights iterator: /bad not found",
                 "num_paused_requests": 0}
UPDATE_OK = {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}


class FakeSGLang:
    """Answers each (method, path) from a queue of (status, body); the last answer repeats.
    Records every request as (method, path, json body)."""

    def __init__(self):
        self.routes: dict[tuple[str, str], list[tuple[int, object]]] = {}
        self.calls: list[tuple[str, str, object]] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self):
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                fake.calls.append((self.command, self.path, json.loads(raw) if raw else None))
                queue = fake.routes.get((self.command, self.path), [(404, {"detail": "Not Found"})])
                status, body = queue.pop(0) if len(queue) > 1 else queue[0]
                data = b"" if body is None else (body.encode() if isinstance(body, str) else json.dumps(body).encode())
                self.send_response(status)
                self.send_header("Content-Type", "text/plain" if isinstance(body, str) else "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _answer

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()

    def on(self, method: str, path: str, *answers: tuple[int, object]) -> None:
        self.routes[(method, path)] = list(answers)

    def bodies(self, path: str) -> list[object]:
        return [body for _, p, body in self.calls if p == path]


@pytest.fixture
def client(fake):
    return SGLangClient(fake.url, timeout_seconds=5, retries=2, backoff_seconds=0.01)


def test_generate_single_parses_sglang_response(fake, client):
    fake.on("POST", "/generate", (200, GENERATE_RESPONSE))
    out = client.generate([1, 2, 3, 4], {"max_new_tokens": 3, "temperature": 1.0}, rid="req-1")
    assert isinstance(out, list) and len(out) == 1
    meta = out[0]["meta_info"]
    assert [tok for _, tok, _ in meta["output_token_logprobs"]] == out[0]["output_ids"]
    assert [lp for lp, _, _ in meta["output_token_logprobs"]] == [-0.5, -1.25, -0.125]
    assert meta["finish_reason"] == {"type": "length", "length": 3}
    assert meta["weight_version"] == "3"
    assert fake.bodies("/generate") == [{"input_ids": [1, 2, 3, 4], "return_logprob": True, "rid": "req-1",
                                         "sampling_params": {"max_new_tokens": 3, "temperature": 1.0}}]


def test_generate_batch_returns_list(fake, client):
    fake.on("POST", "/generate", (200, BATCH_RESPONSE))
    out = client.generate([[1, 2], [3]], {"max_new_tokens": 3})
    assert [r["meta_info"]["finish_reason"]["type"] for r in out] == ["length", "stop"]
    assert "rid" not in fake.bodies("/generate")[0]


def test_score_prompt_reads_input_token_logprobs(fake, client):
    fake.on("POST", "/generate", (200, SCORE_RESPONSE))
    assert client.score_prompt([5, 6, 7]) == [[None, -2.5, -0.75]]
    body = fake.bodies("/generate")[0]
    assert body["sampling_params"]["max_new_tokens"] == 0 and body["logprob_start_len"] == 0


def test_model_info_and_weight_version(fake, client):
    fake.on("GET", "/model_info", (200, MODEL_INFO))  # /get_model_info is a deprecated alias
    assert client.model_info()["model_path"] == "/models/qwen3"
    assert client.weight_version() == "3"


def test_failed_update_raises_engine_error_with_message(fake, client):
    fake.on("POST", "/update_weights_from_disk", (400, UPDATE_FAILED))
    with pytest.raises(EngineError, match="/bad not found") as err:
        client.update_weights_from_disk("/bad", weight_version="4")
    assert err.value.status == 400 and err.value.url.startswith(fake.url)
    # flush_cache and abort_all_requests are sent, not left to SGLang's defaults
    assert fake.bodies("/update_weights_from_disk") == [{"model_path": "/bad", "weight_version": "4",
                                                         "flush_cache": True, "abort_all_requests": False}]


def test_success_false_with_200_is_still_an_error(fake, client):
    fake.on("POST", "/update_weights_from_distributed", (200, {"success": False, "message": "dtype mismatch"}))
    with pytest.raises(EngineError, match="dtype mismatch"):
        client.update_weights_from_distributed(["w"], ["bfloat16"], [[2, 2]], "g", weight_version="5")
    assert fake.bodies("/update_weights_from_distributed")[0] == {
        "names": ["w"], "dtypes": ["bfloat16"], "shapes": [[2, 2]], "group_name": "g",
        "flush_cache": True, "abort_all_requests": False, "weight_version": "5"}


def test_successful_update_returns_body(fake, client):
    fake.on("POST", "/update_weights_from_disk", (200, UPDATE_OK))
    assert client.update_weights_from_disk("/ok")["success"] is True


def test_control_payloads(fake, client):
    for path in ("/abort_request", "/pause_generation", "/continue_generation"):
        fake.on("POST", path, (200, None))
    client.abort()
    client.abort("req-7")
    client.pause("retract")
    client.resume()
    assert fake.bodies("/abort_request") == [{"abort_all": True}, {"rid": "req-7"}]
    assert fake.bodies("/pause_generation") == [{"mode": "retract"}]


def test_flush_cache_retries_while_requests_pending(fake, client):
    pending = "Cache flushed.\n(When there are running or waiting requests, the operation will not be performed.)\n"
    fake.on("POST", "/flush_cache", (400, pending), (400, pending), (200, "Cache flushed.\n"))
    client.flush_cache(timeout_seconds=5, interval=0.01)
    assert len(fake.bodies("/flush_cache")) == 3


def test_idempotent_get_retries_5xx_but_generate_does_not(fake, client):
    fake.on("GET", "/model_info", (503, "starting"), (200, MODEL_INFO))
    assert client.model_info()["weight_version"] == "3"
    fake.on("POST", "/generate", (500, {"error": {"message": "boom"}}))
    with pytest.raises(EngineError) as err:
        client.generate([1], {"max_new_tokens": 1})
    assert err.value.status == 500 and len(fake.bodies("/generate")) == 1


def test_connection_refused_has_no_status():
    dead = SGLangClient(f"http://127.0.0.1:{free_port()}", timeout_seconds=2, retries=1, backoff_seconds=0.01)
    with pytest.raises(EngineError) as err:
        dead.model_info()
    assert err.value.status is None
    assert dead.health() is False


def test_wait_healthy_fails_fast_when_process_exits():
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
    proc.wait()
    dead = SGLangClient(f"http://127.0.0.1:{free_port()}")
    started = time.monotonic()
    with pytest.raises(EngineError, match="exited with code 3"):
        dead.wait_healthy(timeout_seconds=60, process=proc, interval=0.05)
    assert time.monotonic() - started < 5


def test_wait_healthy_polls_until_200(fake):
    fake.on("GET", "/health_generate", (503, None), (503, None), (200, None))
    SGLangClient(fake.url).wait_healthy(timeout_seconds=10, interval=0.01)
    assert len(fake.bodies("/health_generate")) == 3


def test_server_arg_flags():
    flags = server_arg_flags({"mem_fraction_static": 0.7, "enable_memory_saver": True, "skip_server_warmup": False,
                              "dp-size": 2})
    assert flags == ["--mem-fraction-static", "0.7", "--enable-memory-saver", "--dp-size", "2"]


@pytest.mark.parametrize("args, message", [
    ({"made_up_option": 1}, "unknown SGLang server arg 'made_up_option'.*0.5.16, 0.5.17 and 0.5.23"),
    ({"cuda_graph_max_bs": 8}, "unknown SGLang server arg 'cuda_graph_max_bs'"),  # gone in 0.5.23
    ({"disable_cuda_graph": True}, "unknown SGLang server arg 'disable_cuda_graph'"),  # deprecated
    ({"port": 1}, "'port' is set by the launcher"),
    ({"api_key": "secret"}, "'api_key' is set by the launcher"),
    ({"trust_remote_code": "yes"}, "'trust_remote_code' is a flag"),
])
def test_server_args_sglang_would_not_take_fail_before_anything_starts(args, message):
    with pytest.raises(ValueError, match=message):
        server_arg_flags(args)


def test_launcher_command_for_sglang():
    launcher = SGLangLauncher("/models/qwen3", {"tp_size": 2, "random_seed": 7}, port=31000, python="python")
    assert launcher.command() == ["python", "-m", "sglang.launch_server", "--model-path", "/models/qwen3",
                                  "--host", "127.0.0.1", "--port", "31000", "--tp-size", "2", "--random-seed", "7"]
    assert launcher.url == "http://127.0.0.1:31000"


def test_an_api_key_that_starts_with_a_dash_reaches_the_server_intact():
    from miles_core.engines.embedded.http_server import parse_args

    key = "-Xy_" + "k" * 39  # secrets.token_urlsafe draws "-" first once in 64 engine groups
    launcher = SGLangLauncher("/models/qwen3", {}, port=31000, api_key=key)
    assert parse_args(launcher.command()[3:]).api_key == key  # argparse as SGLang's server runs it
