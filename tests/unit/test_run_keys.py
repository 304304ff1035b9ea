"""Run keys name directories and an MLflow filter: only safe ones are accepted, and resuming
a key with no run fails before anything of a run is written."""

import json

import pytest

from flows.rl_posttrain import rl_posttrain
from miles_core.config import load_config
from miles_core.storage.checkpoint import check_run_key
from miles_core.tracking import runs as tracking
from tests.conftest import REPO

RECIPE = str(REPO / "configs/local.yaml")


@pytest.mark.parametrize("key", ["92521669-6824-4ab4-9c67-21547d1d30a4", "local-1733310000", "run_7.b"])
def test_flow_run_ids_and_local_keys_are_run_keys(key):
    assert check_run_key(key) == key


@pytest.mark.parametrize("key", ["", "../etc", "..", "a/b", "x' OR tags.a = 'b", ".hidden", "a" * 129, "run\n1"])
def test_paths_quotes_and_dot_dot_are_not(key):
    with pytest.raises(ValueError, match="invalid run key"):
        check_run_key(key)


@pytest.mark.parametrize("key, message", [("../outside", "invalid run key"),
                                          ("never-ran", "no run with this key .*latest run keys: run-that-exists")])
def test_resume_of_a_bad_or_unknown_key_fails_before_writing(tmp_path, key, message):
    work = tmp_path / "work"
    overrides = [f"storage.work_dir={work}", f"tracking.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}"]
    tracking.start_or_attach_run(load_config(RECIPE, overrides), "run-that-exists", {})
    with pytest.raises(ValueError, match=message):
        rl_posttrain.fn(RECIPE, overrides, resume_from=key)
    assert not (work / "runs").exists() and not (tmp_path / "outside").exists()


def test_show_of_a_truncated_summary_is_a_message(tmp_path):
    from typer.testing import CliRunner

    from flows.cli import app

    (tmp_path / "summary.json").write_text('{"run_key": "abc", "status": "compl')
    result = CliRunner().invoke(app, ["show", str(tmp_path)], terminal_width=200)
    assert result.exit_code == 1 and "not a complete run summary" in " ".join(result.output.split())
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_a_run_whose_creator_died_before_logging_its_config_gets_it_on_attach(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    overrides = [f"storage.work_dir={tmp_path / 'work'}", f"tracking.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}"]
    cfg = load_config(RECIPE, overrides)

    def killed(*args, **kwargs):
        raise KeyboardInterrupt("killed after the run was created")
    with monkeypatch.context() as patch:
        patch.setattr(MlflowClient, "log_batch", killed)
        with pytest.raises(KeyboardInterrupt):
            tracking.start_or_attach_run(cfg, "half-made", {})
    uri, run_id = tracking.start_or_attach_run(cfg, "half-made", {})  # the retry attaches
    run = tracking.client_for(uri).get_run(run_id)
    assert run.data.params["training.lr"] == str(cfg.training.lr) and len(run.data.params) > 50
    client = tracking.client_for(uri)
    assert tracking.CONFIG_ARTIFACT in [a.path for a in client.list_artifacts(run_id, "config")]

    # A run from before the tag existed, resumed with another step count: its file stays the creator's.
    client.delete_tag(run_id, tracking.CONFIG_LOGGED_TAG)
    tracking.start_or_attach_run(load_config(RECIPE, [*overrides, "training.num_steps=7"]), "half-made", {})
    logged = json.loads(open(client.download_artifacts(run_id, tracking.CONFIG_ARTIFACT, str(tmp_path))).read())
    assert logged["training.num_steps"] == str(cfg.training.num_steps) != "7"
