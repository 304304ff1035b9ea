"""The embedded engine over SGLang's HTTP API, driven through SGLangClient, SGLangLauncher and
Router exactly as a GPU cluster drives `sglang.launch_server`."""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import pytest
import requests
import torch
from safetensors.torch import load_file

from miles_core.config import TinyModelConfig
from miles_core.engines.embedded.engine import EmbeddedEngine
from miles_core.engines.embedded.http_server import parse_args, serve
from miles_core.engines.sglang.client import EngineError, SGLangClient, SGLangLauncher
from miles_core.net import free_port, init_custom_process_group
from miles_core.rollout.router import Router
from miles_core.tiny import build_tiny_model
from miles_core.weight_sync.layout import weights_sha256
from miles_core.weight_sync.transports import broadcast_to_engines

torch.set_num_threads(1)
GREEDY = {"max_new_tokens": 4, "temperature": 0.0}
SAMPLED = {"max_new_tokens": 3, "temperature": 1.0}


def _dir_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


def _wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def _finish(response: dict) -> str:
    return response["meta_info"]["finish_reason"]["type"]


class ForwardGate:
    """Holds the engine inside its next forward pass, so a test can act mid-generation."""

    def __init__(self, model: torch.nn.Module):
        self.entered = threading.Event()
        self.release = threading.Event()
        self._hook = model.register_forward_pre_hook(self._wait)

    def _wait(self, module, args):
        self.entered.set()
        self.release.wait(10)

    def close(self) -> None:
        self.release.set()
        self._hook.remove()


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    """A second tiny model with other random weights: the 'trained' weights to push."""
    return build_tiny_model(TinyModelConfig(seed=1), tmp_path_factory.mktemp("target") / "model")


@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> EmbeddedEngine:
    return EmbeddedEngine(str(tiny_model_dir), num_threads=1)


@pytest.fixture
def server(tiny_model_dir):
    handle = serve(tiny_model_dir, num_threads=1)
    yield handle
    handle.stop()


@pytest.fixture
def client(server) -> SGLangClient:
    return SGLangClient(server.url, timeout_seconds=30, retries=1, backoff_seconds=0.05)


# ---- health, info, generation -----------------------------------------------------------------

def test_health_is_503_until_the_model_is_loaded(tiny_model_dir):
    handle = serve(tiny_model_dir, num_threads=1, load=False)
    try:
        client = SGLangClient(handle.url, timeout_seconds=10, retries=0)
        assert requests.get(handle.url + "/health_generate", timeout=5).status_code == 503
        assert not client.health()
        with pytest.raises(EngineError) as err:
            client.generate([5], {"max_new_tokens": 1})
        assert err.value.status == 503
        handle.load_model()
        client.wait_healthy(timeout_seconds=30, interval=0.05)
        assert requests.get(handle.url + "/health", timeout=5).status_code == 200
    finally:
        handle.stop()


def test_model_and_server_info(client, tiny_model_dir):
    info = client.model_info()
    assert info["model_path"] == info["tokenizer_path"] == str(tiny_model_dir)
    assert info["is_generation"] is True and info["weight_version"] == "default"  # SGLang's start
    assert client.server_info()["internal_states"][0]["paused"] is False
    # SGLang's deprecated aliases still answer; /get_weight_version is gone (0.5.23) or 404 (0.5.16)
    assert requests.get(client.base_url + "/get_model_info", timeout=5).json() == info
    assert requests.get(client.base_url + "/get_weight_version", timeout=5).status_code == 404


def test_generate_matches_in_process_engine(client, reference):
    params = {"max_new_tokens": 6, "temperature": 1.0, "sampling_seed": 11}
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    got = client.generate(prompts[0], params) + client.generate(prompts, params)
    # one sampling_params dict: its seed applies to every prompt of the batch, as in SGLang
    want = reference.generate([prompts[0]], params, seeds=[11]) + reference.generate(prompts, params, seeds=[11] * 3)
    for response, expected, prompt in zip(got, want, [prompts[0], *prompts]):
        meta = response["meta_info"]
        assert response["output_ids"] == expected["output_ids"]
        assert [t for _, t, _ in meta["output_token_logprobs"]] == response["output_ids"]
        lps = torch.tensor([lp for lp, _, _ in meta["output_token_logprobs"]])
        ref = torch.tensor([lp for lp, _, _ in expected["meta_info"]["output_token_logprobs"]])
        assert torch.allclose(lps, ref, atol=1e-5, rtol=0)
        assert _finish(response) in ("stop", "length") and 1 <= len(response["output_ids"]) <= 6
        assert meta["completion_tokens"] == len(response["output_ids"]) and meta["prompt_tokens"] == len(prompt)
        assert meta["weight_version"] == "default"
    greedy = client.generate(prompts, GREEDY)
    assert [r["output_ids"] for r in greedy] == [r["output_ids"] for r in reference.generate(prompts, GREEDY)]


def test_sampling_seed_is_per_request(client):
    """SGLang samples each request with its own sampling_seed: one seed shared by a group's n
    samples gives n copies of one sample (zero advantage); a seed per sample gives n samples,
    and the same seeds give the same samples again, in any batch."""
    shared = {"max_new_tokens": 6, "temperature": 1.5}
    prompt, n = [5, 6, 7], 8
    copies = client.generate([prompt] * n, shared | {"sampling_seed": 3})
    assert len({tuple(r["output_ids"]) for r in copies}) == 1
    per_sample = [shared | {"sampling_seed": 100 + j} for j in range(n)]
    group = client.generate([prompt] * n, per_sample)
    assert len({tuple(r["output_ids"]) for r in group}) > 1
    mixed = client.generate([[9, 10], *[prompt] * n], [shared | {"sampling_seed": 7}, *per_sample])
    assert [r["output_ids"] for r in mixed[1:]] == [r["output_ids"] for r in group]
    with pytest.raises(EngineError) as err:
        client.generate([prompt] * 2, [shared, shared | {"max_new_tokens": 2}])
    assert err.value.status == 400


def test_requests_past_the_context_length_or_vocabulary_are_refused_as_sglang_refuses_them(server, client):
    """SGLang's TokenizerManager checks: prompt + max_new_tokens must stay under the context
    length (the model's max_position_embeddings), and every id must be in the vocabulary."""
    config = server.engine.model.config
    context, vocab = config.max_position_embeddings, config.vocab_size
    cases = [([5] * context, {"max_new_tokens": 1}, "is longer than the model's context length"),
             ([5] * 10, {"max_new_tokens": context - 10}, "Requested token count exceeds"),
             ([5, vocab], {"max_new_tokens": 2}, "outside the vocab size")]
    for prompt, params, message in cases:
        with pytest.raises(EngineError, match=message) as err:
            client.generate(prompt, params)
        assert err.value.status == 400
    assert len(client.generate([5] * 10, {"max_new_tokens": context - 11})[0]["output_ids"]) >= 1
    # SamplingParams.verify: an int64 seed, nothing else
    # and the JSON contract of sampling_params (sglang/api/v1/api_types.py): known keys, JSON types
    for params, message in [({"sampling_seed": 2**63}, r"must be in \[-2\*\*63, 2\*\*63 - 1\]"),
                            ({"sampling_seed": 1.5}, "expected i64"), ({"max_new_tokens": 3.0}, "expected i64"),
                            ({"ignore_eos": 1}, "expected bool"), ({"seed": 3}, "unknown field `seed`")]:
        with pytest.raises(EngineError, match=message) as err:
            client.generate([5, 6], {**SAMPLED, **params})
        assert err.value.status == 400
    assert len(client.generate([5, 6], {**SAMPLED, "temperature": 1, "min_p": None})[0]["output_ids"]) >= 1
    assert len(client.generate([5, 6], {**SAMPLED, "sampling_seed": -(2**63)})[0]["output_ids"]) >= 1


def test_every_generation_runs_on_the_one_generation_thread(server, client, monkeypatch):
    """Waiting requests queue on the one generation thread, not on threads of the server's pool
    (which weight updates and scoring need meanwhile)."""
    threads, generate = [], server.engine.generate
    monkeypatch.setattr(server.engine, "generate",
                        lambda *a, **k: threads.append(threading.current_thread().name) or generate(*a, **k))
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda i: client.generate([5, 6, i], {"max_new_tokens": 2}), range(6)))
    assert len(threads) == 6 and len(set(threads)) == 1 and threads[0].startswith("engine-generate")


def test_generate_from_text(server):
    body = {"text": ["1+1=", "2*3="], "sampling_params": GREEDY, "rid": ["a", "b"]}
    out = requests.post(server.url + "/generate", json=body, timeout=30).json()
    assert [r["meta_info"]["id"] for r in out] == ["a", "b"]
    assert [r["meta_info"]["prompt_tokens"] for r in out] == [4, 4]


def test_prefill_scoring_matches_hf_forward(client, reference):
    prompt = [5, 6, 7, 8, 9, 10]
    [scores] = client.score_prompt(prompt)
    assert scores[0] is None and len(scores) == len(prompt)
    with torch.no_grad():
        logits = reference.model(input_ids=torch.tensor([prompt])).logits[0].float()
    expected = torch.log_softmax(logits, -1)[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    assert torch.allclose(torch.tensor(scores[1:]), expected, atol=1e-5, rtol=0)
    [tail] = client.score_prompt(prompt, logprob_start_len=2)
    assert tail == pytest.approx(scores[2:], abs=1e-6)
    [raw] = client.generate(prompt, {"max_new_tokens": 0}, logprob_start_len=0)
    assert raw["output_ids"] == [] and raw["meta_info"]["input_token_logprobs"][0] == [None, prompt[0], None]


# ---- control: pause, abort, flush ---------------------------------------------------------------

def test_pause_holds_requests_until_continue(client):
    client.pause("in_place")
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(client.generate, [5, 6], SAMPLED)
        time.sleep(0.4)
        assert not pending.done()
        assert client.health()  # the server stays responsive while paused
        client.resume()
        [out] = pending.result(timeout=30)
    assert _finish(out) != "abort"


def test_abort_by_rid_while_paused(client):
    client.pause("abort")
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(client.generate, [5, 6], SAMPLED, True, "rid-a")
        second = pool.submit(client.generate, [7, 8], SAMPLED, True, "rid-b")
        _wait_for(lambda: client.server_info()["internal_states"][0]["in_flight"] == 2)
        client.abort("rid-a")
        [aborted] = first.result(timeout=30)
        assert _finish(aborted) == "abort" and aborted["output_ids"] == [] and not second.done()
        client.resume()
        assert _finish(second.result(timeout=30)[0]) != "abort"


def test_abort_all_ends_running_and_queued_requests(server, client, reference):
    prompt = [5, 6, 7]
    # Precondition: greedy decoding of this prompt does not stop at its first token.
    assert _finish(reference.generate([prompt], {"max_new_tokens": 1, "temperature": 0.0})[0]) == "length"
    gate = ForwardGate(server.engine.model)
    try:
        with ThreadPoolExecutor(2) as pool:
            running = pool.submit(client.generate, prompt, {"max_new_tokens": 50, "temperature": 0.0})
            assert gate.entered.wait(10)
            queued = pool.submit(client.generate, [8, 9], {"max_new_tokens": 50})
            _wait_for(lambda: len(server.service.requests) == 2)
            client.abort()
            gate.release.set()
            [ran], [waited] = running.result(timeout=30), queued.result(timeout=30)
    finally:
        gate.close()
    assert _finish(ran) == "abort" and 1 <= len(ran["output_ids"]) < 50
    assert _finish(waited) == "abort" and waited["output_ids"] == []


def test_retract_takes_the_running_request_off_and_continues_it_with_the_new_weights(server, client, reference,
                                                                                    target_dir):
    prompt, params = [5, 6, 7], {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    gate = ForwardGate(server.engine.model)
    try:
        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(client.generate, prompt, params)
            assert gate.entered.wait(10)  # inside its prefill: it retracts after its first token
            client.pause("retract")
            gate.close()
            _wait_for(lambda: server.service.current is None)
            time.sleep(0.2)
            assert not running.done()  # held, not aborted: SGLang's retract
            assert client.update_weights_from_disk(str(target_dir), weight_version="7")["success"]
            client.resume()
            [out] = running.result(timeout=30)
    finally:
        gate.close()
    first = reference.generate([prompt], params | {"max_new_tokens": 1})[0]["output_ids"]
    rest = EmbeddedEngine(str(target_dir), num_threads=1).generate([prompt + first], params | {"max_new_tokens": 11})
    assert out["output_ids"] == first + rest[0]["output_ids"]
    assert (_finish(out), out["meta_info"]["weight_version"], out["meta_info"]["completion_tokens"]) == ("length", "7", 12)


def test_flush_cache_is_refused_while_a_batch_runs(server, client):
    client.flush_cache()
    gate = ForwardGate(server.engine.model)
    try:
        with ThreadPoolExecutor(2) as pool:
            running = pool.submit(client.generate, [5, 6], SAMPLED)
            assert gate.entered.wait(10)
            assert requests.post(server.url + "/flush_cache", timeout=5).status_code == 400
            flushed = pool.submit(client.flush_cache, 10, 0.05)
            time.sleep(0.2)
            gate.release.set()
            flushed.result(timeout=30)
            running.result(timeout=30)
    finally:
        gate.close()


def test_weight_version_and_memory_calls(client):
    assert client.update_weight_version("11")["new_version"] == "11"
    assert client.weight_version() == "11"
    assert client.generate([5], SAMPLED)[0]["meta_info"]["weight_version"] == "11"



def test_release_frees_weights_and_kv_cache_until_resume_and_an_update(client, server, tiny_model_dir):
    """placement.time_sharing's engine side, SGLang's semantics: released weights are gone (the
    storage freed, generation refused), resumed ones are empty until a weight update fills them."""
    before = client.generate([5, 6], GREEDY)[0]["output_ids"]
    client.release_memory(["weights", "kv_cache"])
    assert all(p.untyped_storage().nbytes() == 0 for p in server.engine.model.parameters())
    with pytest.raises(EngineError, match="weights released by /release_memory_occupation"):
        client.generate([5, 6], GREEDY)
    client.resume_memory(["weights"])
    assert all(p.untyped_storage().nbytes() > 0 for p in server.engine.model.parameters())
    with pytest.raises(EngineError, match="weights resumed without their contents: load a weight version"):
        client.generate([5, 6], GREEDY)
    client.update_weights_from_disk(str(tiny_model_dir), weight_version="12")
    client.resume_memory(["kv_cache"])
    out = client.generate([5, 6], GREEDY)[0]
    assert out["output_ids"] == before and out["meta_info"]["weight_version"] == "12"


def test_sglang_memory_flags_bound_the_embedded_engine(tiny_model_dir, monkeypatch):
    """--max-running-requests and --mem-fraction-static reach the engine, from the launcher's
    flags and from rollout.engine (kind embedded) alike."""
    from miles_core.config import RolloutConfig
    from miles_core.engines.embedded import service as engine_service
    from miles_core.rollout.engine_group import launch_engine

    built = []

    def recording_engine(*args, **kwargs):
        built.append(kwargs)
        return EmbeddedEngine(*args, **kwargs)

    monkeypatch.setattr(engine_service, "EmbeddedEngine", recording_engine)
    args = parse_args(["--model-path", str(tiny_model_dir), "--max-running-requests", "3",
                       "--mem-fraction-static", "0.6"])
    flags = {k: v for k, v in vars(args).items() if v not in (None, False) and k not in ("api_key", "model_path")}
    with serve(tiny_model_dir, num_threads=1, server_args=flags) as handle:
        assert handle.service.engine.max_batch_size == 3
        assert SGLangClient(handle.url).server_info()["mem_fraction_static"] == "0.6"
    engine = RolloutConfig.model_validate({"engine": {"kind": "embedded", "mem_fraction_static": 0.7,
                                                      "max_running_requests": 5}}).engine
    handle = launch_engine(engine, str(tiny_model_dir), "127.0.0.1", "float32", 1, 0, api_key="k")
    handle.stop()
    assert [(b.get("max_batch_size"), b.get("mem_fraction_static")) for b in built] == [(3, 0.6), (5, 0.7)]
    with pytest.raises(ValueError, match="less than 1"):
        RolloutConfig.model_validate({"engine": {"kind": "embedded", "mem_fraction_static": 1.2}})


# ---- weight updates -----------------------------------------------------------------------------

def test_update_weights_from_disk(server, client, target_dir, tmp_path):
    target_sha = weights_sha256(_dir_tensors(target_dir))
    assert server.engine.weights_sha256() != target_sha
    before = client.generate([5, 6, 7], GREEDY)[0]
    assert client.update_weights_from_disk(str(target_dir), weight_version="5")["success"]
    assert server.engine.weights_sha256() == target_sha
    assert requests.get(server.url + "/get_weights_checksum", timeout=10).json()["sha256"] == target_sha
    assert client.weight_version() == "5" and client.model_info()["model_path"] == str(target_dir)
    after = client.generate([5, 6, 7], GREEDY)[0]
    assert after["meta_info"]["weight_version"] == "5"
    assert after["meta_info"]["output_token_logprobs"] != before["meta_info"]["output_token_logprobs"]
    with pytest.raises(EngineError, match="safetensors") as err:
        client.update_weights_from_disk(str(tmp_path), weight_version="6")
    assert err.value.status == 400
    assert client.weight_version() == "5" and server.engine.weights_sha256() == target_sha


def test_weight_update_waits_for_the_running_generation(server, client, target_dir):
    gate = ForwardGate(server.engine.model)
    try:
        with ThreadPoolExecutor(2) as pool:
            running = pool.submit(client.generate, [5, 6, 7], GREEDY)
            assert gate.entered.wait(10)
            update = pool.submit(client.update_weights_from_disk, str(target_dir), "2")
            time.sleep(0.3)
            assert not update.done()  # blocked behind the generation lock
            gate.release.set()
            [out] = running.result(timeout=30)
            update.result(timeout=30)
    finally:
        gate.close()
    assert out["meta_info"]["weight_version"] == "default" and client.weight_version() == "2"


def test_with_an_api_key_only_health_is_open(tiny_model_dir, target_dir):
    handle = serve(tiny_model_dir, num_threads=1, api_key="k-123")
    try:
        assert requests.get(handle.url + "/health_generate", timeout=5).status_code == 200
        for path, body in (("/generate", {"input_ids": [5, 6], "sampling_params": GREEDY}),
                           ("/update_weights_from_disk", {"model_path": str(target_dir)}),
                           ("/init_weights_update_group", {"master_address": "10.0.0.1", "master_port": 1,
                                                           "rank_offset": 1, "world_size": 2, "group_name": "g"}),
                           ("/pause_generation", {})):
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                assert requests.post(handle.url + path, json=body, headers=headers, timeout=5).status_code == 401
        assert requests.get(handle.url + "/model_info", timeout=5).status_code == 401
        client = SGLangClient(handle.url, timeout_seconds=30, retries=0, api_key="k-123")
        assert client.update_weights_from_disk(str(target_dir), weight_version="4")["success"]
        assert client.generate([5, 6], GREEDY)[0]["meta_info"]["weight_version"] == "4"
    finally:
        handle.stop()


def test_generation_after_an_unflushed_weight_update_is_refused(server, client, target_dir):
    """SGLang's radix cache keeps prefix KV of the old weights when an update says
    flush_cache=false; the stand-in refuses to generate until the cache is flushed."""
    body = {"model_path": str(target_dir), "weight_version": "3", "flush_cache": False}
    assert requests.post(server.url + "/update_weights_from_disk", json=body, timeout=30).json()["success"]
    with pytest.raises(EngineError, match="flush_cache=false") as err:
        client.generate([5, 6], GREEDY)
    assert err.value.status == 400
    client.flush_cache()
    assert client.generate([5, 6], GREEDY)[0]["meta_info"]["weight_version"] == "3"


def test_weight_updates_over_http_take_checkpoint_expert_names_only(tiny_moe_model_dir, tmp_path):
    """SGLang's Qwen3-MoE loader skips transformers' fused expert names and reports success; the
    stand-in answers 400 for them, and loads the checkpoint's per-expert names."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from miles_core.weight_sync.layout import checkpoint_layout

    fused = {k: v.clone() for k, v in AutoModelForCausalLM.from_pretrained(tiny_moe_model_dir).state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in fused)
    for layout, tensors in (("fused", fused), ("checkpoint", {k: v.clone() for k, v in checkpoint_layout(fused).items()})):
        (tmp_path / layout).mkdir()
        save_file(tensors, str(tmp_path / layout / "model.safetensors"))
    handle = serve(tiny_moe_model_dir, num_threads=1)
    try:
        client = SGLangClient(handle.url, timeout_seconds=30, retries=0)
        with pytest.raises(EngineError, match="unknown parameter names.*gate_up_proj"):
            client.update_weights_from_disk(str(tmp_path / "fused"), weight_version="1")
        assert client.update_weights_from_disk(str(tmp_path / "checkpoint"), weight_version="2")["success"]
    finally:
        handle.stop()


# ---- a launched subprocess, and a gloo weight broadcast into it ----------------------------------
# The three tests below share one server process (start-up costs seconds); they run in file order
# and the last one stops it.

@pytest.fixture(scope="module")
def launched(tiny_model_dir, tmp_path_factory):
    launcher = SGLangLauncher(
        tiny_model_dir, {"random_seed": 1, "skip_server_warmup": True, "weight_version": "0"},
        module="miles_core.engines.embedded.http_server", env={"OMP_NUM_THREADS": "1"},
        log_path=tmp_path_factory.mktemp("engine") / "engine.log", poll_interval=0.2, startup_timeout=120)
    client = launcher.start(timeout_seconds=60)
    yield launcher, client
    launcher.stop()


def test_launched_server_serves_at_its_starting_weight_version(launched):
    launcher, client = launched
    cmd = launcher.command()
    assert cmd[1:3] == ["-m", "miles_core.engines.embedded.http_server"] and "--skip-server-warmup" in cmd
    info = client.server_info()
    assert info["random_seed"] == "1" and info["skip_server_warmup"] is True
    assert client.weight_version() == "0"  # --weight-version, not SGLang's "default"
    [out] = client.generate([5, 6, 7], GREEDY)
    assert 1 <= len(out["output_ids"]) <= GREEDY["max_new_tokens"]


@pytest.fixture
def trainer_group(launched):
    """A weight-update group of this process (rank 0, the trainer) and the launched server (rank 1)."""
    _, client = launched
    group, port = "miles_test_sender", free_port()
    with ThreadPoolExecutor(1) as pool:
        joined = pool.submit(client.init_weights_update_group, "127.0.0.1", port, 1, 2, group, "gloo")
        pg = init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", world_size=2, rank=0,
                                       group_name=group, timeout=timedelta(seconds=120))
        assert joined.result(timeout=60)["success"]
    yield group, pg
    client.destroy_weights_update_group(group)
    torch.distributed.destroy_process_group(pg)


def test_update_weights_from_distributed(launched, trainer_group, target_dir):
    _, client = launched
    group, pg = trainer_group
    tensors = _dir_tensors(target_dir)
    names = sorted(tensors)
    dtypes = [str(tensors[n].dtype).removeprefix("torch.") for n in names]
    shapes = [list(tensors[n].shape) for n in names]
    with pytest.raises(EngineError, match="must run between begin_weight_update"):  # as SGLang 0.5.23
        client.update_weights_from_distributed(names, dtypes, shapes, group, "9")
    with ThreadPoolExecutor(1) as pool, client.weight_update_session():
        update = pool.submit(client.update_weights_from_distributed, names, dtypes, shapes, group, "9")
        for name in names:
            torch.distributed.broadcast(tensors[name].contiguous(), src=0, group=pg)
        assert update.result(timeout=60)["success"]
    checksum = requests.get(client.base_url + "/get_weights_checksum", timeout=10).json()["sha256"]
    assert checksum == weights_sha256(tensors)
    assert client.weight_version() == "9"
    assert client.generate([5, 6], GREEDY)[0]["meta_info"]["weight_version"] == "9"


def test_a_bucketed_broadcast_flushes_the_cache_once_after_its_last_bucket(launched, trainer_group, target_dir,
                                                                            monkeypatch):
    _, client = launched
    group, pg = trainer_group
    flushes = []
    update = SGLangClient.update_weights_from_distributed

    def recorded(self, *args):
        flushes.append(args[-1])
        return update(self, *args)

    monkeypatch.setattr(SGLangClient, "update_weights_from_distributed", recorded)
    tensors = _dir_tensors(target_dir)
    broadcast_to_engines(tensors, pg, [client.base_url], group, "10", bucket_bytes=2**12)
    assert len(flushes) > 2 and flushes == [False] * (len(flushes) - 1) + [True]
    assert client.weight_version() == "10"
    # the stand-in refuses to generate on a cache left unflushed after a weight change, as SGLang would serve stale KV
    assert client.generate([5, 6], GREEDY)[0]["meta_info"]["weight_version"] == "10"


def test_an_engine_refusing_an_update_fails_the_broadcast_at_once_with_its_message(launched, trainer_group,
                                                                                  target_dir):
    """A refusing engine never joins the broadcast: the sender must not wait for the group's timeout."""
    _, client = launched
    _, pg = trainer_group
    started = time.monotonic()
    with pytest.raises(EngineError, match="no weights update group 'not-joined'"):
        broadcast_to_engines(_dir_tensors(target_dir), pg, [client.base_url], "not-joined", "11", bucket_bytes=2**20)
    assert time.monotonic() - started < 30  # the group's timeout is 120 s
    assert client.weight_version() != "11"


def test_weight_update_sessions_open_and_close_as_sglangs(server, client):
    """SGLang 0.5.23's rules: one session at a time, no end without a begin, a known selector;
    a session a dead sender left open is closed by the next sender's session."""
    begin = f"{server.url}/begin_weight_update"
    assert requests.post(begin, json={"selector": "draft"}, timeout=10).json()["success"]
    refused = requests.post(begin, json={}, timeout=10)
    assert refused.status_code == 400 and "already open" in refused.json()["message"]
    with client.weight_update_session():  # closes the left-open one, then opens its own
        assert server.service.weight_update_selector == "all"
    assert server.service.weight_update_selector is None
    with pytest.raises(EngineError, match="no weight-update session is open"):
        client._post_result("/end_weight_update", {})
    assert requests.post(begin, json={"selector": "both"}, timeout=10).status_code == 400
    with pytest.raises(RuntimeError), client.weight_update_session():
        raise RuntimeError("the broadcast failed")
    assert server.service.weight_update_selector is None  # closed for the next attempt


def test_launcher_stop_leaves_no_process(launched):
    launcher, client = launched
    pid = launcher.process.pid
    launcher.stop()
    assert launcher.process is None and not client.health(timeout=2)
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)


def test_server_cli_rejects_what_sglang_rejects(capsys):
    args = parse_args(["--model-path", "m", "--port", "1234", "--tp-size", "1", "--enable-metrics"])
    assert args.port == 1234 and args.enable_metrics and args.tp_size == "1"
    # an unknown flag, a flag 0.5.23 removed (a prefix of two options there), more ranks than it has
    for bad in (["--some-future-flag", "7"], ["--cuda-graph-max-bs", "8"], ["--tp-size", "2"]):
        with pytest.raises(SystemExit) as exit_:
            parse_args(["--model-path", "m", *bad])
        assert exit_.value.code == 2
    assert "unrecognized arguments: --cuda-graph-max-bs" in capsys.readouterr().err


# ---- router -------------------------------------------------------------------------------------

@pytest.fixture
def two_servers(tiny_model_dir):
    handles = [serve(tiny_model_dir, num_threads=1) for _ in range(2)]
    yield handles
    for handle in handles:
        handle.stop()


def _router(handles, **kwargs) -> Router:
    return Router([SGLangClient(h.url, timeout_seconds=30, retries=0) for h in handles], **kwargs)


def test_router_sends_to_least_in_flight(two_servers):
    router = _router(two_servers)
    direct = [SGLangClient(h.url) for h in two_servers]
    for c in direct:
        c.pause("in_place")  # hold requests on the engines so in-flight counts stay put
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(router.generate, [5 + i, 6], SAMPLED) for i in range(4)]
        _wait_for(lambda: sum(s["in_flight"] for s in router.stats()) == 4)
        assert [s["in_flight"] for s in router.stats()] == [2, 2]
        for c in direct:
            c.resume()
        outs = [f.result(timeout=30) for f in futures]
    assert all(_finish(o[0]) != "abort" for o in outs)
    assert [s["served"] for s in router.stats()] == [2, 2]


def test_router_fails_over_and_readmits(two_servers, tiny_model_dir):
    first, second = two_servers
    router = _router(two_servers)
    for _ in range(4):
        router.generate([5, 6], SAMPLED)
    assert [s["served"] for s in router.stats()] == [2, 2]
    first.stop()
    outs = [router.generate([5, 6], SAMPLED) for _ in range(4)]
    assert all(_finish(o[0]) != "abort" for o in outs)
    dead, alive = router.stats()
    assert not dead["healthy"] and dead["failures"] == 1 and alive["served"] == 6
    assert router.check_health() == {first.url: False, second.url: True}
    restarted = serve(tiny_model_dir, port=first.port, num_threads=1)
    try:
        assert router.check_health() == {first.url: True, second.url: True}
        for _ in range(2):
            router.generate([5, 6], SAMPLED)
        assert router.stats()[0]["served"] == 3
    finally:
        restarted.stop()


def test_router_background_health_checks(two_servers, tiny_model_dir):
    first, second = two_servers
    with _router(two_servers, health_check_interval=0.05) as router:
        first.stop()
        _wait_for(lambda: router.healthy_urls == [second.url])
        restarted = serve(tiny_model_dir, port=first.port, num_threads=1)
        try:
            _wait_for(lambda: len(router.healthy_urls) == 2)
        finally:
            restarted.stop()
