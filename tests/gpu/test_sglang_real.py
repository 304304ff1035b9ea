"""The SGLang path against a REAL SGLang server (0.5.17) on a lent GPU (not run in CI).

Every path a one-GPU cluster run takes: the launcher with a recipe's server args and a separate
interpreter (`rollout.engine.python`), generation through the router with per-sample seeds,
the colocated (cuda_ipc) and disk weight transports, broadcast where NCCL allows it, pause and
abort around an update, memory release/resume, and a SIGKILLed server. Set up with
tests/gpu/carry.py (here) and tests/gpu/install.sh (there), then:

    SGLANG_PYTHON=/tmp/sgl-python python3 -m pytest tests/gpu/test_sglang_real.py -s
"""

from __future__ import annotations

import os
import secrets
import signal
import sys
import threading
import time
import types
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
try:
    import ray  # noqa: F401
except ImportError:  # engine_group imports Ray at module level; launch_engine never calls it
    sys.modules["ray"] = types.ModuleType("ray")

SGLANG_PYTHON = os.environ.get("SGLANG_PYTHON")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"),
              pytest.mark.skipif(not SGLANG_PYTHON, reason="set SGLANG_PYTHON to an interpreter that has SGLang")]

# The one-GPU recipe's args (configs/gpu-single-sglang.yaml); the carried kernel wheel has no FA3.
SERVER_ARGS = {"attention_backend": "triton", "sampling_backend": "pytorch", "grammar_backend": "none",
               "mem_fraction_static": 0.3, "enable_memory_saver": True, "enable_deterministic_inference": True,
               "skip_server_warmup": True, "random_seed": 0}
SHAPE = {"hidden_size": 512, "num_hidden_layers": 6, "num_attention_heads": 8, "num_key_value_heads": 4,
         "head_dim": 64, "intermediate_size": 1536}
CONTEXT_TOKENS = 4096  # SGLang refuses (400) a request whose prompt + max_new_tokens exceed it
# bf16 serving against an fp32 teacher-forced forward: measured 0.003 mean on the 0.6B shape.
MEAN_LOGPROB_BOUND = 0.02


def say(message: str) -> None:
    print(f"[sglang-real] {message}", flush=True)


def build_model(out: Path, seed: int) -> Path:
    from transformers import Qwen3Config

    from miles_core.tiny import build_tokenizer, save_random_model

    tokenizer = build_tokenizer()
    config = Qwen3Config(vocab_size=len(tokenizer), max_position_embeddings=CONTEXT_TOKENS, tie_word_embeddings=True,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
                         torch_dtype="float32", **SHAPE)
    return save_random_model(config, tokenizer, out, seed)


def hf_model(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()


@torch.no_grad()
def teacher_logprobs(model, prompt: list[int], output: list[int]) -> list[float]:
    ids = torch.tensor([prompt + output], device="cuda")
    logp = model(ids).logits.float().log_softmax(-1)[0, len(prompt) - 1:-1]
    return logp.gather(-1, torch.tensor(output, device="cuda")[:, None])[:, 0].tolist()


def mean_abs_diff(model, prompts: list[list[int]], responses: list[dict]) -> float:
    diffs = []
    for prompt, response in zip(prompts, responses):
        entries = response["meta_info"]["output_token_logprobs"]
        output = [int(e[1]) for e in entries]
        reference = teacher_logprobs(model, prompt, output)
        diffs += [abs(e[0] - r) for e, r in zip(entries, reference)]
    return sum(diffs) / len(diffs)


PROMPTS = [[2, 5 + i, 6, 7 + (i % 5), 3] for i in range(16)]  # role, digits, end-of-turn tokens


def sample(client, seeds: list[int], max_new_tokens: int = 24, **extra) -> list[dict]:
    params = [{"temperature": 1.0, "max_new_tokens": max_new_tokens, "sampling_seed": s} for s in seeds]
    return client.generate(PROMPTS[:len(seeds)], params, **extra)


def output_ids(responses: list[dict]) -> list[list[int]]:
    return [[int(e[1]) for e in r["meta_info"]["output_token_logprobs"]] for r in responses]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("sglang-real")


@pytest.fixture(scope="module")
def models(work) -> dict[str, Path]:
    return {"v0": build_model(work / "v0", seed=0), "v1": build_model(work / "v1", seed=1),
            "v2": build_model(work / "v2", seed=2)}


@pytest.fixture(scope="module")
def engine(models, work):
    """One server for the module, started as an engine actor starts it (launch_engine)."""
    from miles_core.config.rollout import SGLangEngineConfig
    from miles_core.rollout.engine_group import launch_engine

    cfg = SGLangEngineConfig(server_args=SERVER_ARGS, python=SGLANG_PYTHON)
    api_key = secrets.token_urlsafe(16)
    started = time.perf_counter()
    launcher = launch_engine(cfg, str(models["v0"]), "127.0.0.1", "bfloat16", 4, 1.0, api_key)
    say(f"healthy in {time.perf_counter() - started:.1f} s at {launcher.url}")
    state = {"launcher": launcher, "api_key": api_key}
    yield state
    state["launcher"].stop()


def client_of(engine):
    from miles_core.engines.sglang.client import SGLangClient

    return SGLangClient(engine["launcher"].url, api_key=engine["api_key"], timeout_seconds=300)


def test_serves_the_recipe_args_behind_its_key(engine):
    import requests

    client = client_of(engine)
    info = client.server_info()
    assert info["attention_backend"] == "triton" and info["enable_deterministic_inference"] is True
    assert info["enable_memory_saver"] is True and info["tp_size"] == 1
    assert client.weight_version() == "0"  # launch_engine's initial version, not SGLang's "default"
    unkeyed = requests.post(engine["launcher"].url + "/update_weight_version", json={"new_version": "x"}, timeout=30)
    assert unkeyed.status_code == 401
    assert client.weight_version() == "0"


def test_router_samples_per_seed_with_logprobs_of_the_served_weights(engine, models):
    from miles_core.rollout.router import Router

    router = Router([client_of(engine)])
    first = router.generate(PROMPTS, [{"temperature": 1.0, "max_new_tokens": 24, "sampling_seed": 100 + i}
                                      for i in range(len(PROMPTS))])
    again = router.generate(PROMPTS, [{"temperature": 1.0, "max_new_tokens": 24, "sampling_seed": 100 + i}
                                      for i in range(len(PROMPTS))])
    other = router.generate(PROMPTS, [{"temperature": 1.0, "max_new_tokens": 24, "sampling_seed": 900 + i}
                                      for i in range(len(PROMPTS))])
    router.close()
    same = sum(a == b for a, b in zip(output_ids(first), output_ids(again)))
    differ = sum(a != b for a, b in zip(output_ids(first), output_ids(other)))
    say(f"same seeds: {same}/{len(PROMPTS)} identical; other seeds: {differ}/{len(PROMPTS)} differ")
    assert same == len(PROMPTS), "enable_deterministic_inference: the same sampling_seed must give the same sample"
    assert differ >= len(PROMPTS) - 1
    assert {r["meta_info"]["weight_version"] for r in first} == {"0"}
    diff = mean_abs_diff(hf_model(models["v0"]), PROMPTS, first)
    say(f"log-prob |SGLang bf16 - fp32 teacher-forced| mean {diff:.4f}")
    assert diff < MEAN_LOGPROB_BOUND


def test_cuda_ipc_update_serves_the_new_weights(engine, models):
    from miles_core.weight_sync.cuda_ipc import send_weights_over_cuda_ipc

    client = client_of(engine)
    model = hf_model(models["v1"])
    state = {name: tensor.detach() for name, tensor in model.state_dict().items()}
    started = time.perf_counter()
    sent = send_weights_over_cuda_ipc(state, [engine["launcher"].url], "1", 8 << 20, torch.bfloat16,
                                      api_key=engine["api_key"])
    say(f"cuda_ipc: {sent * 2 / 2**20:.1f} MiB in {1000 * (time.perf_counter() - started):.1f} ms (8 MiB buckets)")
    assert client.weight_version() == "1"
    responses = sample(client, list(range(8)))
    assert {r["meta_info"]["weight_version"] for r in responses} == {"1"}
    diff_new = mean_abs_diff(model, PROMPTS[:8], responses)
    diff_old = mean_abs_diff(hf_model(models["v0"]), PROMPTS[:8], responses)
    say(f"after cuda_ipc: log-prob diff to new weights {diff_new:.4f}, to old {diff_old:.4f}")
    assert diff_new < MEAN_LOGPROB_BOUND < diff_old


def test_disk_update_serves_the_new_weights(engine, models):
    client = client_of(engine)
    started = time.perf_counter()
    client.update_weights_from_disk(str(models["v2"]), weight_version="2")
    say(f"disk update: {time.perf_counter() - started:.2f} s")
    assert client.weight_version() == "2"
    responses = sample(client, list(range(8)))
    assert mean_abs_diff(hf_model(models["v2"]), PROMPTS[:8], responses) < MEAN_LOGPROB_BOUND


def test_pause_update_continue_with_requests_in_flight(engine, models):
    """The order SGLang documents around an update: pause, push, version, continue. Requests in
    flight come back (aborted or finished) instead of hanging; later ones see the new weights."""
    from miles_core.weight_sync.cuda_ipc import send_weights_over_cuda_ipc

    client = client_of(engine)
    results: list = []
    flight = threading.Thread(target=lambda: results.append(sample(client, list(range(16)), max_new_tokens=200)))
    flight.start()
    time.sleep(0.3)
    client.pause("abort")
    model = hf_model(models["v1"])
    send_weights_over_cuda_ipc({n: t.detach() for n, t in model.state_dict().items()}, [engine["launcher"].url], "3",
                               8 << 20, torch.bfloat16, api_key=engine["api_key"])
    client.resume()
    flight.join(timeout=120)
    assert not flight.is_alive(), "requests in flight hung across pause/update/continue"
    reasons = sorted({r["meta_info"]["finish_reason"]["type"] for r in results[0]})
    say(f"in flight across the update: finish reasons {reasons}")
    after = sample(client, list(range(8)))
    assert {r["meta_info"]["weight_version"] for r in after} == {"3"}
    assert mean_abs_diff(model, PROMPTS[:8], after) < MEAN_LOGPROB_BOUND


def test_abort_all_returns_running_requests_at_once(engine):
    client = client_of(engine)
    results: list = []
    params = [{"temperature": 1.0, "max_new_tokens": 4000, "ignore_eos": True, "sampling_seed": i} for i in range(8)]
    flight = threading.Thread(target=lambda: results.append(client.generate(PROMPTS[:8], params)))
    flight.start()
    time.sleep(1.0)
    aborted = time.perf_counter()
    client.abort()
    flight.join(timeout=30)
    assert not flight.is_alive()
    say(f"abort_all: requests back in {time.perf_counter() - aborted:.2f} s")
    assert {r["meta_info"]["finish_reason"]["type"] for r in results[0]} == {"abort"}


def test_broadcast_cannot_share_one_gpu(engine, models):
    """Trainer (rank 0, this process) and engine (rank 1) on the same GPU, as the broadcast
    transport connects them: SGLang joins the group, then NCCL refuses the first broadcast
    ("Duplicate GPU detected", measured with NCCL 2.28.9 on an H100). This is why validation
    refuses broadcast where a trainer or an engine holds a fraction of a GPU, and `auto` picks
    cuda_ipc there; across GPUs broadcast is the default (its CPU test runs over gloo). If this
    test fails because the broadcast went through, NCCL has lifted the limit: lift the rule."""
    from concurrent.futures import ThreadPoolExecutor
    from datetime import timedelta

    from miles_core.net import free_port, init_custom_process_group
    from miles_core.weight_sync.transports import broadcast_to_engines

    client = client_of(engine)
    address, port = "127.0.0.1", free_port("127.0.0.1")
    with ThreadPoolExecutor(1) as pool:
        joined = pool.submit(client.init_weights_update_group, address, port, 1, 2, "miles-weights-gpu", "nccl")
        group = init_custom_process_group("nccl", f"tcp://{address}:{port}", 2, 0, "miles-weights-gpu",
                                          timeout=timedelta(seconds=90))
        assert joined.result(timeout=120)["success"]
    model = hf_model(models["v2"])
    with pytest.raises(torch.distributed.DistBackendError, match="Duplicate GPU detected"):
        broadcast_to_engines({n: t.detach() for n, t in model.state_dict().items()}, group, [engine["launcher"].url],
                             "miles-weights-gpu", "5", 8 << 20, engine["api_key"], dtype=torch.bfloat16)
    say("broadcast on one GPU: NCCL refuses two ranks on one device")


def test_release_and_resume_memory_around_an_update(engine, models):
    from miles_core.weight_sync.cuda_ipc import send_weights_over_cuda_ipc

    client = client_of(engine)
    torch.cuda.synchronize()
    held = torch.cuda.mem_get_info()[0]
    client.release_memory(["kv_cache", "weights"])
    released = torch.cuda.mem_get_info()[0]
    say(f"release_memory_occupation freed {(released - held) / 2**30:.1f} GiB")
    assert released - held > 10 * 2**30  # the KV cache alone is 30% of the GPU
    client.resume_memory(["weights"])  # weights before an update, as SGLang requires
    model = hf_model(models["v2"])
    send_weights_over_cuda_ipc({n: t.detach() for n, t in model.state_dict().items()}, [engine["launcher"].url], "4",
                               8 << 20, torch.bfloat16, api_key=engine["api_key"])
    client.resume_memory(["kv_cache"])
    after = sample(client, list(range(8)))
    assert {r["meta_info"]["weight_version"] for r in after} == {"4"}
    assert mean_abs_diff(model, PROMPTS[:8], after) < MEAN_LOGPROB_BOUND


def test_sigkilled_server_frees_the_gpu_and_restarts(engine, models):
    """An engine killed hard (OOM killer, lost actor) leaves no process holding GPU memory, and a
    new one starts in its place."""
    from miles_core.config.rollout import SGLangEngineConfig
    from miles_core.rollout.engine_group import launch_engine

    launcher = engine["launcher"]
    pgid = launcher.process.pid
    serving_free = torch.cuda.mem_get_info()[0]
    os.kill(pgid, signal.SIGKILL)  # the server's leader only, as the OOM killer would
    time.sleep(10)
    # Measured on SGLang 0.5.17: its scheduler and detokenizer outlive the leader (they still hold
    # the GPU after 60 s), so the engine's recovery must end the whole process group.
    say(f"10 s after SIGKILL, the server's children still run: {_group_alive(pgid)}")
    launcher.stop()  # what EngineGroup.heal does first
    assert not _group_alive(pgid), "a process of the killed server outlived stop()"
    freed = (torch.cuda.mem_get_info()[0] - serving_free) / 2**30
    say(f"stop() after SIGKILL freed {freed:.1f} GiB")
    assert freed > 10  # the KV cache alone is 30% of the GPU
    started = time.perf_counter()
    engine["launcher"] = launch_engine(SGLangEngineConfig(server_args=SERVER_ARGS, python=SGLANG_PYTHON), str(models["v0"]),
                                       "127.0.0.1", "bfloat16", 4, 1.0, engine["api_key"])
    say(f"restarted in {time.perf_counter() - started:.1f} s")
    assert client_of(engine).weight_version() == "0"


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
