"""Registry promotion behind the eval gate on a real MLflow (sqlite) and a real Prefect
transaction, champion download, and the rl-eval flow."""

import os
import shutil
import tempfile
from pathlib import Path

# Prefect reads its settings when first imported: point it at a throwaway ephemeral server
# before anything below imports it (setdefault: an enclosing test session's choice wins).
os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="miles-test-prefect-"))
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("PREFECT_RESULTS_PERSIST_BY_DEFAULT", "false")
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")

import pytest
import torch
from mlflow.tracking import MlflowClient
from prefect import flow
from transformers import AutoModelForCausalLM, AutoTokenizer

import tasks.promote
from miles_core.config import RunConfig
from miles_core.data import read_prompts
from miles_core.evaluation.core import evaluate_greedy
from miles_core.tracking import registry
from miles_core.tracking import runs as tracking
from tasks.promote import PromotionRolledBack, promote
from tests.conftest import REPO


def empty_response(response: str, label: str) -> float:
    """A reward the random tiny model earns on some prompts (it often emits eos at once), so
    that pass@1 comparisons below are not all 0 == 0."""
    return float(response == "")


@pytest.fixture(scope="module", autouse=True)
def quick_prefect():
    """Flow-run heartbeats (crash detection for deployments) make every flow run wait ~1 s on
    exit for the heartbeat thread; none is needed here."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    with temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
        yield
    # Stopped here, not at interpreter exit where its log line hits pytest's closed streams;
    # queued logs/events go first, else their workers retry against a dead server at exit.
    APILogWorker.drain_all(timeout=10)
    EventsWorker.drain_all(timeout=10)
    SubprocessASGIServer().stop()


@flow(name="promotion-test")
def promotion(uri: str, name: str, version: str, min_score: float = 0.0, min_improvement: float = 0.0) -> dict:
    return promote(uri, name, version, min_score, min_improvement)


@pytest.fixture(scope="module")
def mlflow_uri(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    MlflowClient(uri).create_experiment("rl-posttrain", artifact_location=(root / "artifacts").as_uri())
    return uri


def register(uri: str, model_dir, name: str, score: float) -> str:
    client = tracking.client_for(uri)
    run = client.create_run(client.get_experiment_by_name("rl-posttrain").experiment_id)
    return str(tracking.register_model(uri, run.info.run_id, name, str(model_dir), {"eval_pass_at_1": str(score)},
                                       step=0))


def alias(uri: str, name: str, which: str = "champion") -> str | None:
    return registry.champion(uri, name)[0] if which == "champion" else \
        str(MlflowClient(uri, registry_uri=uri).get_model_version_by_alias(name, which).version)


def tags(uri: str, name: str, version: str) -> dict:
    return MlflowClient(uri, registry_uri=uri).get_model_version(name, version).tags


def test_gate_promotes_better_models_and_keeps_worse_ones_candidate(mlflow_uri, tiny_model_dir):
    name = "gate"
    v1 = register(mlflow_uri, tiny_model_dir, name, 0.30)
    assert promotion(mlflow_uri, name, v1)["promoted"] and alias(mlflow_uri, name) == v1
    v2 = register(mlflow_uri, tiny_model_dir, name, 0.50)
    decision = promotion(mlflow_uri, name, v2, min_improvement=0.1)
    assert decision["promoted"] and decision["champion_version"] == v1 and alias(mlflow_uri, name) == v2
    assert tags(mlflow_uri, name, v2)["promotion"] == "champion"
    assert tags(mlflow_uri, name, v1)["superseded_by"] == v2

    v3 = register(mlflow_uri, tiny_model_dir, name, 0.55)  # better, but not by the margin
    decision = promotion(mlflow_uri, name, v3, min_improvement=0.1)
    assert not decision["promoted"] and decision["champion"] == v2
    assert alias(mlflow_uri, name) == v2 and alias(mlflow_uri, name, "candidate") == v3
    assert tags(mlflow_uri, name, v3)["promotion"] == "rejected"
    assert f"does not beat champion v{v2}" in tags(mlflow_uri, name, v3)["promotion_reason"]

    v4 = register(mlflow_uri, tiny_model_dir, name, 0.90)
    assert not promotion(mlflow_uri, name, v4, min_score=0.95)["promoted"]
    assert "below the floor" in tags(mlflow_uri, name, v4)["promotion_reason"] and alias(mlflow_uri, name) == v2
    assert not promotion(mlflow_uri, name, v2)["promoted"]  # already champion: a no-op, tags untouched
    assert tags(mlflow_uri, name, v2)["promotion"] == "champion"


def _half_done_tagging(monkeypatch):
    """record_decision that writes its first tag for real, then fails like a dropped connection."""
    def fail_midway(uri, name, version, decision):
        MlflowClient(uri, registry_uri=uri).set_model_version_tag(name, version, "promotion", "champion")
        raise RuntimeError("injected: tracking server went away while tagging")

    monkeypatch.setattr(tasks.promote, "record_decision", fail_midway)


def test_failed_tagging_rolls_back_to_the_previous_champion(mlflow_uri, tiny_model_dir, monkeypatch):
    name = "rollback"
    v1 = register(mlflow_uri, tiny_model_dir, name, 0.2)
    promotion(mlflow_uri, name, v1)
    v2 = register(mlflow_uri, tiny_model_dir, name, 0.8)
    _half_done_tagging(monkeypatch)
    with pytest.raises(PromotionRolledBack, match="injected") as info:
        promotion(mlflow_uri, name, v2)
    assert isinstance(info.value.__cause__, RuntimeError)
    assert alias(mlflow_uri, name) == v1  # the set-champion-alias rollback hook ran
    assert tags(mlflow_uri, name, v2)["promotion"] == "rolled_back"
    assert "superseded_by" not in tags(mlflow_uri, name, v1)

    monkeypatch.undo()  # the next attempt, with tagging healthy, promotes as usual
    assert promotion(mlflow_uri, name, v2)["promoted"] and alias(mlflow_uri, name) == v2


def test_failed_first_promotion_leaves_no_champion(mlflow_uri, tiny_model_dir, monkeypatch):
    name = "rollback-first"
    v1 = register(mlflow_uri, tiny_model_dir, name, 0.5)
    _half_done_tagging(monkeypatch)
    with pytest.raises(PromotionRolledBack):
        promotion(mlflow_uri, name, v1)
    assert alias(mlflow_uri, name) is None and alias(mlflow_uri, name, "candidate") == v1


def test_a_retried_registration_reuses_its_version_and_a_later_step_gets_its_own(mlflow_uri, tmp_path):
    """A resumed run registers again: the same step (a retry) gets its version back, a later
    step a new version, and the earlier version's weights stay as they were."""
    import mlflow

    name, client = "resumed", tracking.client_for(mlflow_uri)
    run_id = client.create_run(client.get_experiment_by_name("rl-posttrain").experiment_id).info.run_id
    exports = {step: tmp_path / f"export{step}" for step in (10, 14)}
    for step, export in exports.items():
        export.mkdir()
        (export / "weights.txt").write_text(f"step {step}")
    first = tracking.register_model(mlflow_uri, run_id, name, str(exports[10]), {}, step=10)
    assert tracking.register_model(mlflow_uri, run_id, name, str(exports[10]), {}, step=10) == first
    later = tracking.register_model(mlflow_uri, run_id, name, str(exports[14]), {}, step=14)
    assert later != first and alias(mlflow_uri, name, "candidate") == later
    assert len(client.search_model_versions(f"name = '{name}'")) == 2
    source = client.get_model_version(name, first).source
    local = mlflow.artifacts.download_artifacts(artifact_uri=source, dst_path=str(tmp_path / "v1"),
                                                tracking_uri=mlflow_uri)
    assert (Path(local) / "weights.txt").read_text() == "step 10"


def test_champion_downloads_and_generates(mlflow_uri, tiny_model_dir, tmp_path):
    name = "download"
    version = register(mlflow_uri, tiny_model_dir, name, 0.4)
    promotion(mlflow_uri, name, version)
    local = registry.load_champion(mlflow_uri, name, tmp_path / "champion")
    assert (local / "config.json").is_file() and (local / "model.safetensors").is_file()
    assert (local / "model.safetensors").read_bytes() == (tiny_model_dir / "model.safetensors").read_bytes()
    tokenizer = AutoTokenizer.from_pretrained(local)
    model = AutoModelForCausalLM.from_pretrained(local).eval()
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "2+3="}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
    assert out.shape[1] == ids.shape[1] + 3
    with pytest.raises(LookupError, match="no such model/alias"):
        registry.load_champion(mlflow_uri, "never-registered", tmp_path / "none")


@pytest.fixture(scope="module")
def eval_recipe(mlflow_uri, tmp_path_factory):
    work = tmp_path_factory.mktemp("eval-work")
    overrides = [f"storage.work_dir={work}", f"tracking.tracking_uri={mlflow_uri}", "data.builtin.num_train=8",
                 "data.builtin.num_eval=24", "eval.max_new_tokens=3",
                 "rollout.reward=tests.integration.test_registry:empty_response"]
    return str(REPO / "configs/local.yaml"), overrides


def _reference_pass_at_1(model_dir, cfg: RunConfig, eval_path) -> float:
    from miles_core.engines.embedded.engine import EmbeddedEngine

    engine = EmbeddedEngine(str(model_dir), num_threads=2)
    prompts = read_prompts(eval_path, cfg.data, engine.tokenizer)
    return evaluate_greedy(engine, prompts, cfg.rollout.reward, cfg.eval.max_new_tokens, cfg.eval.batch_size).pass_at_1


def test_rl_eval_flow_on_export_registry_version_and_checkpoint(mlflow_uri, tiny_model_dir, eval_recipe, tmp_path):
    from flows.rl_eval import rl_eval
    from miles_core.config import load_config
    from miles_core.data import write_arithmetic_task

    config_path, overrides = eval_recipe
    cfg = load_config(config_path, overrides)
    _, eval_path = write_arithmetic_task(cfg.data.builtin, tmp_path / "data")  # same seed: the same file
    expected = _reference_pass_at_1(tiny_model_dir, cfg, eval_path)
    assert 0 < expected < 1, expected

    version = register(mlflow_uri, tiny_model_dir, "evaluated", 0.1)
    promotion(mlflow_uri, "evaluated", version)
    checkpoint = tmp_path / "step_000010"  # a training checkpoint: weights only, no config/tokenizer
    checkpoint.mkdir()
    shutil.copy2(tiny_model_dir / "model.safetensors", checkpoint / "model.safetensors")
    client = MlflowClient(mlflow_uri)
    for uri in (str(tiny_model_dir), "models:/evaluated@champion", checkpoint.as_uri()):
        summary = rl_eval(uri, config_path, overrides)
        assert summary["results"]["heldout"]["pass@1"] == expected, uri
        run = client.get_run(summary["mlflow"]["run_id"])
        assert run.data.tags["miles.eval_of"] == uri and run.info.status == "FINISHED"
        assert run.data.metrics["eval/after/heldout/pass_at_1"] == expected
        logged = {a.path for folder in ("eval", "plots") for a in client.list_artifacts(run.info.run_id, folder)}
        assert {"eval/report.json", "eval/report.md", "eval/samples.json", "eval/results.json",
                "plots/eval.png", "plots/reward_curve.png"} <= logged
