"""Two Ray nodes on one machine: trainer on one, two engines on the other; broadcast weight
sync verified equal; an engine SIGKILLed mid-rollout is restarted and the run completes."""

import os
import signal
import threading

import pytest
import ray
import torch
from ray.cluster_utils import Cluster
from safetensors.torch import load_file

from miles_core.config import build_config
from miles_core.data import write_arithmetic_task
from miles_core.driver.session import TrainSpec, run_training

NUM_STEPS = 6


@pytest.fixture(scope="module")
def two_nodes():
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"trainer_node": 1}})
    cluster.add_node(num_cpus=1, resources={"rollout_node": 2})
    ray.init(address=cluster.address)
    cluster.wait_for_nodes()
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def spec(tmp_path, tiny_model_dir, transport: str) -> TrainSpec:
    train, _ = write_arithmetic_task(build_config({}).data.builtin, tmp_path / "data")
    cfg = build_config({}, [
        f"training.num_steps={NUM_STEPS}", "checkpoint.interval_steps=3", "training.num_threads=1",
        "rollout.num_engines=2", "rollout.cpus_per_engine=0.5", "training.cpus_per_trainer=1",
        "rollout.num_prompts_per_step=8", "rollout.num_samples_per_prompt=4",
        f"rollout.weight_transport={transport}", "rollout.verify_weight_sync=true",
        "rollout.request_timeout_seconds=30",
        "placement.trainer_resources={trainer_node: 1}", "placement.engine_resources={rollout_node: 1}"])
    return TrainSpec(config=cfg, model_dir=str(tiny_model_dir), train_path=str(train),
                     run_dir=str(tmp_path / "run"))


def actor_nodes(class_name: str) -> set[str]:
    from ray.util.state import list_actors

    return {a.node_id for a in list_actors(filters=[("class_name", "=", class_name), ("state", "=", "ALIVE")])}


def test_broadcast_sync_across_nodes_verified_equal(two_nodes, tmp_path, warm_tiny):
    tiny_model_dir = warm_tiny["warm"]  # a model that scores: its weights move every step
    placed = {}

    def on_step(state):
        if state.step == 1:
            placed["trainer"], placed["engines"] = actor_nodes("FSDPTrainer"), actor_nodes("EngineActor")

    result = run_training(spec(tmp_path, tiny_model_dir, "broadcast"), on_step=on_step)
    assert result.steps == NUM_STEPS
    assert len(placed["trainer"]) == 1 and len(placed["engines"]) == 1
    assert placed["trainer"] != placed["engines"]  # disaggregated: different nodes
    assert all(h["weights/broadcast_gbytes"] > 0 for h in result.history)
    # every step's rollout came from the weights the trainer had: the broadcast was delivered
    assert max(h["rollout/train_logprob_abs_diff"] for h in result.history) <= 1e-4
    initial = load_file(f"{tiny_model_dir}/model.safetensors")
    exported = load_file(f"{result.hf_export_dir}/model.safetensors")
    assert any(not torch.equal(exported[k], initial[k]) for k in initial)


def test_engine_killed_mid_rollout_is_restarted(two_nodes, tmp_path, warm_tiny, monkeypatch):
    tiny_model_dir = warm_tiny["warm"]
    from miles_core.rollout.engine_group import EngineGroup

    original, armed, killed = EngineGroup.generate, threading.Event(), threading.Event()

    def generate_then_kill(self, input_ids, sampling_params):
        if armed.is_set() and not killed.is_set():
            killed.set()
            victim = ray.get(self.actors[0].pid.remote())
            # SIGKILL engine 0 while this rollout's requests are being served.
            threading.Timer(0.01, os.kill, (victim, signal.SIGKILL)).start()
        return original(self, input_ids, sampling_params)

    monkeypatch.setattr(EngineGroup, "generate", generate_then_kill)
    result = run_training(spec(tmp_path, tiny_model_dir, "broadcast"),
                          on_step=lambda state: state.step == 2 and armed.set())
    assert killed.is_set()
    assert result.steps == NUM_STEPS
    assert [h["step"] for h in result.history] == list(range(1, NUM_STEPS + 1))
    assert sum(h["rollout/engine_restarts"] for h in result.history) == 1
    # the restarted engine got the current weights, not its model directory's
    assert max(h["rollout/train_logprob_abs_diff"] for h in result.history) <= 1e-4
