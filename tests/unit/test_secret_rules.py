"""Secrets never reach Prefect, MLflow or the run directory: secret names in any case or
camelCase, credentials in query strings and commands; env and config files stay owner-only
even when they existed with a wider mode."""

import json

import pytest
from prefect.utilities.callables import parameter_schema
from prefect.utilities.schema_tools.validation import validate

from flows.rl_posttrain import _open_run_dir, rl_posttrain
from infra import stack
from miles_core.config import build_config
from miles_core.tracking import runs as tracking

SECRET = "hunter2-s3cr3t"
SECRET_OVERRIDES = [f"rollout.engine.server_args.{name}={SECRET}"
                    for name in ("AUTH_TOKEN", "Password", "HF_TOKEN", "accessToken", "clientSecret")] + [
    f"model.source=https://hub.example/m?api_key={SECRET}", f"data.train_path=https://data.example/t.jsonl?token={SECRET}",
    f"eval.external_command=curl --header X-Token={SECRET} -o {{output_json}} https://eval.example"]


def test_the_deployment_schema_refuses_every_secret_override():
    schema = parameter_schema(rl_posttrain.fn).model_dump_for_openapi()  # what `prefect deploy` registers

    def accepted(override: str) -> bool:
        return not validate({"overrides": [override]}, schema)  # as Prefect's server checks a run's parameters

    assert [o for o in SECRET_OVERRIDES if accepted(o)] == []
    assert accepted("training.num_steps=3") and accepted("rollout.max_new_tokens=8")
    assert accepted("rollout.remote_reward.api_key_env=REWARD_KEY")  # the name of a variable


def test_stored_config_hides_query_and_command_secrets_and_files_are_owner_only(tmp_path):
    cfg = build_config({"storage": {"work_dir": str(tmp_path / "work")},
                        "data": {"train_path": f"https://data.example/t.jsonl?token={SECRET}&split=train"},
                        "eval": {"external_command": f"curl -H 'Authorization: Bearer {SECRET}' --header "
                                                     f"X-Token={SECRET} https://eval.example/?api_key={SECRET}"}})
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "RUN_KEY").write_text("run-1")  # a retry of this run, whose earlier attempt left a wide mode
    (run_dir / "config.resolved.json").write_text("{}")
    (run_dir / "config.resolved.json").chmod(0o644)
    _open_run_dir(cfg, "run-1", None, str(run_dir))
    resolved = (run_dir / "config.resolved.json").read_text()
    params = json.dumps(tracking.flatten(cfg.model_dump(mode="json")))  # MLflow params and config artifact
    for stored in (resolved, params):
        assert SECRET not in stored
        assert "?token=<redacted>&split=train" in stored and "X-Token=<redacted>" in stored
    assert (run_dir / "config.resolved.json").stat().st_mode & 0o777 == 0o600

    (tmp_path / "stack").mkdir()
    (tmp_path / "stack" / "env").write_text("")
    (tmp_path / "stack" / "env").chmod(0o644)
    stack._write_env_file(tmp_path / "stack", {"AWS_SECRET_ACCESS_KEY": SECRET, "RAY_AUTH_TOKEN": SECRET})
    assert (tmp_path / "stack" / "env").stat().st_mode & 0o777 == 0o600
    assert stack.mask_env(stack.read_env_file(tmp_path / "stack")) == {"AWS_SECRET_ACCESS_KEY": "****",
                                                                       "RAY_AUTH_TOKEN": "****"}


@pytest.mark.parametrize("name", ["AUTH_TOKEN", "Password", "HF_TOKEN", "accessToken", "clientSecret"])
def test_config_values_under_any_case_secret_names_are_redacted(name):
    assert tracking.flatten({"rollout": {"engine": {"server_args": {name: SECRET}}}}) == {
        f"rollout.engine.server_args.{name}": "<redacted>"}
