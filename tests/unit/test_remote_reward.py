"""rollout.remote_reward against a local HTTP reward server: answers become rewards; 500s and
timeouts are retried, then fail the step clearly; a refusal (4xx) is not retried; the key
comes from the environment."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from miles_core.config import RolloutConfig
from miles_core.rollout.remote_reward import RemoteRewardClient, RemoteRewardError
from miles_core.types import Prompt, Sample


class RewardServer:
    """Answers POSTs per `script` (one entry per request, the last repeats): an int status, a
    float number of seconds to stall, "ok" (reward = len(response) of each sample) or "short"
    (one reward too few)."""

    def __init__(self, script: list):
        self.script, self.requests, self.headers = script, [], []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append(body)
                server.headers.append(dict(self.headers))
                action = server.script[min(len(server.requests), len(server.script)) - 1]
                if isinstance(action, float):
                    time.sleep(action)
                    action = "ok"
                if action in ("ok", "short"):
                    rewards = [float(len(r)) for r in body["responses"]]
                    payload, status = {"rewards": rewards[: -1] if action == "short" else rewards}, 200
                else:
                    payload, status = {"error": "scripted"}, action
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/score"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()


@pytest.fixture
def serve():
    servers = []

    def start(script):
        servers.append(RewardServer(script))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def _client(url: str, **settings) -> RemoteRewardClient:
    cfg = RolloutConfig(remote_reward={"url": url, "timeout_seconds": 0.5, "max_attempts": 3,
                                       "backoff_seconds": 0.01, **settings})
    return RemoteRewardClient(cfg.remote_reward)


def _batch(n: int = 5):
    prompts = {i: Prompt(i, f"q{i}", str(i), metadata={"id": i}) for i in range(2)}
    samples = [Sample(i % 2, [1], [2], str(i % 2), response_text="x" * i) for i in range(n)]
    return samples, prompts


def test_rewards_come_back_in_order_in_batches_with_prompts_labels_and_metadata(serve):
    server = serve(["ok"])
    samples, prompts = _batch(5)
    assert _client(server.url, max_batch_size=2).score(samples, prompts) == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert [len(r["responses"]) for r in server.requests] == [2, 2, 1]
    assert server.requests[0] == {"prompts": ["q0", "q1"], "responses": ["", "x"], "labels": ["0", "1"],
                                  "metadata": [{"id": 0}, {"id": 1}]}


def test_a_500_is_retried_then_succeeds(serve):
    server = serve([500, 503, "ok"])
    samples, prompts = _batch(2)
    assert _client(server.url).score(samples, prompts) == [0.0, 1.0]
    assert len(server.requests) == 3


@pytest.mark.parametrize(("script", "reason"), [([500], "HTTP 500"), ([2.0], "Timeout")], ids=["500", "timeout"])
def test_a_failing_reward_model_is_retried_then_fails_the_step_clearly(serve, script, reason):
    server = serve(script)
    samples, prompts = _batch(2)
    started = time.perf_counter()
    with pytest.raises(RemoteRewardError, match=f"failed 3 attempts; last: .*{reason}"):
        _client(server.url).score(samples, prompts)
    assert len(server.requests) == 3
    assert time.perf_counter() - started < 10


def test_a_refusal_is_not_retried(serve):
    server = serve([422])
    with pytest.raises(ValueError, match="refused the batch .*HTTP 422"):
        _client(server.url).score(*_batch(2))
    assert len(server.requests) == 1


def test_a_wrong_number_of_rewards_fails_clearly(serve):
    server = serve(["short"])
    with pytest.raises(ValueError, match="returned 2 rewards for 3 samples"):
        _client(server.url).score(*_batch(3))


def test_the_key_comes_from_the_environment(serve, monkeypatch):
    server = serve(["ok"])
    with pytest.raises(ValueError, match=r"api_key_env: \$REWARD_KEY is not set"):
        _client(server.url, api_key_env="REWARD_KEY")
    monkeypatch.setenv("REWARD_KEY", "k-123")
    _client(server.url, api_key_env="REWARD_KEY").score(*_batch(1))
    assert server.headers[-1]["Authorization"] == "Bearer k-123"


def test_the_rollout_manager_scores_its_batch_with_the_reward_model(serve):
    from miles_core.rollout.manager import RolloutManager

    class Engines:
        num_healthy = 1

        def generate(self, input_ids, sampling_params, **extra):
            return [{"output_ids": [5] * (i + 1), "text": "y" * (i + 1),
                     "meta_info": {"output_token_logprobs": [[-1.0, 5, None]] * (i + 1),
                                   "finish_reason": {"type": "length"}, "weight_version": "0"}}
                    for i in range(len(input_ids))]

    server = serve(["ok"])
    rollout = RolloutConfig(num_samples_per_prompt=2, remote_reward={"url": server.url, "timeout_seconds": 5})
    samples = RolloutManager(Engines(), rollout, "exact_match").generate([Prompt(0, "q", "yy", [1, 2])], seed=0)
    assert [s.reward for s in samples] == [1.0, 2.0]  # the server's, not exact_match's
    assert server.requests[0]["labels"] == ["yy", "yy"]


def test_preflight_reports_a_missing_key_before_anything_starts(monkeypatch):
    from miles_core.config import build_config
    from miles_core.preflight import _reward_problems

    monkeypatch.delenv("REWARD_KEY", raising=False)
    cfg = build_config({"rollout": {"remote_reward": {"url": "http://127.0.0.1:9/score", "api_key_env": "REWARD_KEY"}}})
    assert list(_reward_problems(cfg)) == ["rollout.remote_reward.api_key_env: $REWARD_KEY is not set in this environment"]
    monkeypatch.setenv("REWARD_KEY", "k")
    assert list(_reward_problems(cfg)) == []
