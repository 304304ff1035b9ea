"""Secrets in the environment never reach MLflow: params, tags, metrics, artifacts, registry;
redaction goes by name pattern; store downloads stay in their target directory."""

import json
import os

os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")

from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from miles_core.config import RunConfig, build_config
from miles_core.evaluation import reports
from miles_core.tracking import runs as tracking
from miles_core.types import EvalResult

FAKE_SECRETS = {
    "AWS_SECRET_ACCESS_KEY": "fakeAwsSecret/9f3Kq2LmZx7Rt0Vb",
    "AWS_ACCESS_KEY_ID": "AKIAFAKEKEYID7Q2W3E4",
    "HF_TOKEN": "hf_fakeTokenQWERTYasdfgh123456",
}

BEFORE = {"heldout": EvalResult(pass_at_k={1: 0.25}, num_prompts=4)}
AFTER = {"heldout": EvalResult(pass_at_k={1: 0.75}, mean_reward_at_n={1: 0.75}, num_prompts=4, examples=[
    {"prompt": [{"role": "user", "content": "1+2="}], "label": "3", "responses": ["3"], "rewards": [1.0]}])}


def _leaks(text: str) -> list[str]:
    return [name for name, value in FAKE_SECRETS.items() if value in text]


def test_nothing_from_the_environment_reaches_the_run(tmp_path, monkeypatch, tiny_model_dir):
    for name, value in FAKE_SECRETS.items():
        monkeypatch.setenv(name, value)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = build_config({"storage": {"work_dir": str(tmp_path / "work"), "object_store_uri": "s3://bucket/runs"},
                        "tracking": {"tracking_uri": uri}})
    uri, run_id = tracking.start_or_attach_run(cfg, "secrets-run", {"miles.flow_run_id": "local"})
    tracking.log_eval_file(uri, run_id, "after", AFTER["heldout"])
    reports.log_eval_metrics(uri, run_id, "after", AFTER, step=1)
    reports.log_report(uri, run_id, BEFORE, AFTER, [0.1, 0.4, 0.6])
    version = tracking.register_model(uri, run_id, "secrets-model", str(tiny_model_dir), {"eval_pass_at_1": "0.75"}, step=3)
    tracking.finish(uri, run_id, "FINISHED")

    client = MlflowClient(uri, registry_uri=uri)
    run = client.get_run(run_id)
    assert len(run.data.params) > 50  # the whole flattened config was logged
    for kind, values in {"params": run.data.params, "tags": run.data.tags,
                         "metrics": {k: str(v) for k, v in run.data.metrics.items()},
                         "model version tags": client.get_model_version("secrets-model", version).tags}.items():
        for key, value in values.items():
            assert not _leaks(f"{key}={value}"), (kind, key)

    local = Path(client.download_artifacts(run_id, "", str(tmp_path / "artifacts")))
    files = [p for p in local.rglob("*") if p.is_file()]
    assert {"eval/report.json", "eval/samples.json", "plots/eval.png", "hf_export/step_000003/config.json"} <= \
        {p.relative_to(local).as_posix() for p in files}
    assert (local / "plots" / "eval.png").read_bytes()[:4] == b"\x89PNG"
    for path in files:
        assert not _leaks(path.read_bytes().decode("latin-1")), path
    # and the tracking database itself, every table at once
    assert not _leaks((tmp_path / "mlflow.db").read_bytes().decode("latin-1"))


def test_config_fields_that_look_like_secrets_are_redacted():
    flat = tracking.flatten({
        "storage": {"object_store_uri": "s3://bucket/prefix", "aws_secret_access_key": "s3cr3t"},
        "hub": {"HF_TOKEN": "hf_abc", "api_key": "k-123", "password": "hunter2", "aws_access_key_id": "AKIA1"},
        "tracking": {"token": ""},  # empty: nothing to hide, kept visible as empty
    })
    assert flat["storage.object_store_uri"] == "s3://bucket/prefix"
    for key in ("storage.aws_secret_access_key", "hub.HF_TOKEN", "hub.api_key", "hub.password",
                "hub.aws_access_key_id"):
        assert flat[key] == "<redacted>", key
    assert flat["tracking.token"] == ""
    assert not any(v in " ".join(flat.values()) for v in ("s3cr3t", "hf_abc", "k-123", "hunter2", "AKIA1"))


def test_redaction_goes_by_name_pattern_at_any_depth_and_spares_counts():
    tree = {"eval": {"external_command": "curl https://user:pw@host/x", "headers": {"Authorization": "Bearer z"}},
            "env": [{"name": "A", "api-key": "k1"}, {"apikey": "k2", "private_key": "k3"}],
            "db": {"passwd": "p1", "credentials": "c1"}, "rollout": {"max_new_tokens": 8}}
    redacted = tracking.redact(tree)
    text = json.dumps(redacted)
    assert not any(s in text for s in ("user:pw", "Bearer z", "k1", "k2", "k3", "p1", "c1")), text
    assert redacted["rollout"]["max_new_tokens"] == 8 and redacted["env"][0]["name"] == "A"
    # no field of the schema itself is mistaken for a secret
    assert "<redacted>" not in tracking.flatten(RunConfig().model_dump(mode="json")).values()


def test_download_refuses_keys_that_escape_the_target(tmp_path):
    import fsspec

    from miles_core.storage.object_store import download_dir

    memory = fsspec.filesystem("memory")
    memory.pipe("/slip/ok.txt", b"1")
    memory.pipe("/slip/sub/../../../escaped.txt", b"x")
    with pytest.raises(ValueError, match="escape"):
        download_dir("memory://slip", tmp_path / "dst")
    assert not (tmp_path / "dst").exists() and not list(tmp_path.parent.glob("escaped.txt"))
