"""`rollout.engine: sglang` end to end on CPU: the launcher, flags, weight versions, broadcast
group, dedicated eval engines and process clean-up that a cluster runs, with the embedded
server standing in for `sglang.launch_server` (rollout.engine.server_module)."""

import os
import signal
import time

import psutil
import ray
import requests

from miles_core.config import build_config
from miles_core.driver.session import TrainSpec, run_training
from miles_core.evaluation.core import evaluate_all
from miles_core.rollout.engine_group import EngineGroup

SERVER_MODULE = "miles_core.engines.embedded.http_server"
NUM_STEPS = 4


def server_pids(model_dir) -> set[int]:
    """Every engine server process launched as `python -m miles_core.engines.embedded.http_server` for
    model_dir (other tests, maybe running beside this one, serve other models)."""
    pids = set()
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if SERVER_MODULE in cmdline and str(model_dir) in cmdline:
            pids.add(proc.info["pid"])
    return pids


def wait_gone(pids: set[int], timeout_seconds: float = 30.0) -> set[int]:
    """The pids still alive after up to timeout_seconds."""
    deadline = time.monotonic() + timeout_seconds
    while (alive := {p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"}):
        if time.monotonic() > deadline:
            break
        time.sleep(0.2)
    return alive


def sglang_config(warm_tiny, extra: list[str] = ()):
    return build_config({}, [
        "rollout.engine={kind: sglang, server_module: " + SERVER_MODULE + ", server_args: {skip_server_warmup: true}}",
        "rollout.gpus_per_engine=0", "rollout.cpus_per_engine=0.5", "training.cpus_per_trainer=1",
        "rollout.weight_transport=broadcast", "training.num_threads=1", f"training.num_steps={NUM_STEPS}",
        "checkpoint.interval_steps=2", "rollout.num_prompts_per_step=8", "rollout.num_samples_per_prompt=4",
        "rollout.request_timeout_seconds=60", "rollout.health_timeout_seconds=10", *extra])


def test_sglang_engine_run_with_restart_and_dedicated_eval_leaves_no_server(ray_local, tmp_path, warm_tiny):
    assert not server_pids(warm_tiny["warm"])
    # a tiny lr: the periodic evals must score what the warm model scores, so wrong weights on
    # the dedicated engine would show
    cfg = sglang_config(warm_tiny, ["training.lr=1e-7", "eval.interval_steps=2", "eval.periodic_engines=dedicated",
                                    "eval.num_dedicated_engines=1"])
    seen: dict[int, set[int]] = {}

    def kill_a_server(state):
        seen[state.step] = server_pids(warm_tiny["warm"])
        if state.step == 1:  # SIGKILL one server: the next rollout finds it dead and restarts it
            os.kill(min(seen[1]), signal.SIGKILL)

    spec = TrainSpec(config=cfg, model_dir=str(warm_tiny["warm"]), train_path=str(warm_tiny["train"]),
                     eval_path=str(warm_tiny["eval"]), run_dir=str(tmp_path / "run"))
    result = run_training(spec, on_step=kill_a_server)
    # the engines started at weight version "0" (not SGLang's "default"): step 1 did not fail
    assert result.steps == NUM_STEPS
    assert [h["rollout/weight_version"] for h in result.history] == [0.0, 1.0, 2.0, 3.0]
    assert len(seen[1]) == 2  # the rollout engine and the dedicated eval engine
    assert len(seen[3]) == 2 and seen[3] != seen[1]  # a new server replaced the killed one
    # every sync went over the broadcast group into the launched servers, rebuilt after the restart
    assert all(h["weights/broadcast_gbytes"] > 0 for h in result.history)
    assert max(h["rollout/train_logprob_abs_diff"] for h in result.history) <= 1e-4
    # the dedicated eval engine got the weights from disk (SGLang takes no in-process tensors)
    warm_score = evaluate_all(cfg, warm_tiny["warm"], warm_tiny["eval"])["heldout"].pass_at_1
    assert [e["step"] for e in result.periodic_eval] == [2, 4]
    assert all(abs(e["eval/periodic/heldout/pass_at_1"] - warm_score) <= 0.05 for e in result.periodic_eval)
    assert not wait_gone(set().union(*seen.values()) | server_pids(warm_tiny["warm"]))  # no server outlived the run


def test_a_killed_engine_actor_takes_its_server_with_it(ray_local, warm_tiny):
    """ray.kill runs no shutdown hook: the server, a child of the actor, must not keep its GPU."""
    engines = EngineGroup(sglang_config(warm_tiny), str(warm_tiny["warm"]))
    try:
        [pid] = server_pids(warm_tiny["warm"])
        assert engines.router.slots[0].client.weight_version() == "0"
        # the server was started with the group's key, and requires it
        assert f"--api-key={engines.api_key}" in psutil.Process(pid).cmdline()
        assert requests.get(engines.urls[0] + "/model_info", timeout=10).status_code == 401
        ray.kill(engines.actors[0], no_restart=True)
        assert not wait_gone({pid})
    finally:
        engines.shutdown()
    assert not server_pids(warm_tiny["warm"])
