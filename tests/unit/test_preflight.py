"""Bad inputs fail before anything is written: `miles plan` and `miles run` check the model,
every data row, rewards, lengths and the store, and name each problem at once (exit 2)."""

import json
import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from flows.cli import app
from miles_core.config import build_config
from miles_core.preflight import PreflightError, preflight
from tests.conftest import REPO

RECIPE = str(REPO / "configs/local.yaml")
GOOD_ROW = {"prompt": [{"role": "user", "content": "1+1="}], "label": "2"}


def write_rows(path, rows) -> str:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return str(path)


@pytest.mark.parametrize("row, problem", [
    ({"prompt": 5, "label": "2"}, "expected a string or a non-empty list of messages, got int"),
    ({"prompt": [{"role": "user"}], "label": "2"}, "message 0 needs a string 'content'"),
    ({"prompt": ["a", "b"], "label": "2"}, "message 0 needs a string 'content'"),
    ({"prompt": "1+1=", "label": None}, "or it is null"),
    ({"prompt": "1+1=", "label": {"v": 2}}, "must be a string or a number, got dict"),
    ("not json", "not JSON"),
    ('["a"]', "expected a JSON object, got list"),
])
def test_each_bad_row_is_named_with_file_and_line(tmp_path, row, problem):
    path = write_rows(tmp_path / "train.jsonl", [GOOD_ROW, row])
    with pytest.raises(PreflightError) as err:
        preflight(build_config({}, [f"data.train_path={path}"]))
    assert f"data.train_path: {path}:2: " in str(err.value) and problem in str(err.value)


def test_a_row_that_is_not_utf8_is_named_with_file_and_line(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_bytes((json.dumps(GOOD_ROW) + "\n").encode() * 2 + b'{"prompt": "caf\xe9", "label": "2"}\n')
    with pytest.raises(PreflightError, match=rf"data.train_path: {path}:3: not UTF-8 text"):
        preflight(build_config({}, [f"data.train_path={path}"]))


@pytest.fixture
def s3_bucket(monkeypatch, tmp_path):
    """A moto S3 server holding bucket `miles`, and an environment with no AWS credentials
    (no variables, no shared files, no instance metadata)."""
    import boto3
    from moto import settings
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    for key in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", f"http://{host}:{port}")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    for key in ("AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"):
        monkeypatch.setenv(key, str(tmp_path / "none"))
    boto3.client("s3", aws_access_key_id="k", aws_secret_access_key="s").create_bucket(Bucket="miles")
    yield settings
    server.stop()


def test_s3_store_credentials_are_not_reported_as_a_missing_bucket(s3_bucket, monkeypatch):
    """s3fs's exists() is False whatever failed: without credentials the store was said not to exist."""
    def store_problems(uri: str) -> str:
        with pytest.raises(PreflightError) as err:
            preflight(build_config({}, [f"storage.object_store_uri={uri}"]))
        return str(err.value)

    found = store_problems("s3://miles/runs")
    assert "storage.object_store_uri: s3://miles: no usable S3 credentials" in found and "does not exist" not in found
    assert "AWS_ACCESS_KEY_ID" in found
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    assert "bucket other does not exist" in store_problems("s3://other/runs")
    preflight(build_config({}, ["storage.object_store_uri=s3://miles/runs"]))
    monkeypatch.setattr(s3_bucket, "INITIAL_NO_AUTH_ACTION_COUNT", 0)  # moto checks keys: ours are unknown
    assert "the S3 credentials were refused for bucket miles" in store_problems("s3://miles/runs")


def test_every_problem_is_reported_at_once(tmp_path):
    cfg = build_config({}, [f"data.train_path={tmp_path / 'missing.jsonl'}", f"model.source={tmp_path}",
                            "rollout.reward=no_such_reward", "eval.datasets=[{name: aime, path: /nope.jsonl}]"])
    with pytest.raises(PreflightError) as err:
        preflight(cfg)
    for field in ("model.source", "data.train_path", "rollout.reward", "eval.datasets[aime].path"):
        assert f"  {field}: " in str(err.value), field


def test_new_tokens_beyond_the_models_positions():
    with pytest.raises(PreflightError, match="do not fit the model's 256 positions"):
        preflight(build_config({}, ["rollout.max_new_tokens=300"]))


def test_plan_and_run_exit_2_and_write_nothing(tmp_path):
    bad = write_rows(tmp_path / "train.jsonl", [{"prompt": "1+1=", "label": None}])
    work = tmp_path / "work"
    for command in ("plan", "run"):
        result = CliRunner().invoke(app, [command, RECIPE, "--set", f"data.train_path={bad}",
                                          "--set", f"storage.work_dir={work}"], terminal_width=200)
        assert result.exit_code == 2, result.output
        assert "train.jsonl:1: no 'label'" in " ".join(result.output.split())  # rich wraps long lines
    assert not work.exists()
    assert CliRunner().invoke(app, ["plan", RECIPE], terminal_width=200).exit_code == 0


def test_the_checks_load_transformers_quietly(tmp_path):
    """transformers reads its progress-bar and verbosity settings once, when first imported (by
    the input checks or a later stage): the CLI sets them as it loads a recipe, so a run's log
    has no progress bars (a user's own setting wins)."""
    code = ("import sys; from pathlib import Path; from flows import cli; "
            f"cli._load(Path({RECIPE!r}), ['storage.work_dir={tmp_path}']); "
            "import transformers.utils.logging as t; "
            "print(t.is_progress_bar_enabled(), t.get_verbosity())")
    quiet = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_", "TOKENIZERS_"))}
    for env, expected in ((quiet, "False 40"), (quiet | {"TRANSFORMERS_VERBOSITY": "info"}, "False 20")):
        proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env | {"PYTHONPATH": str(REPO)},
                              capture_output=True, text=True, timeout=120)
        assert proc.stdout.split() == expected.split(), proc.stdout + proc.stderr[-2000:]
