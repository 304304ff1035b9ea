"""Inputs refused early and the same way whatever their spelling: a file:// model source gets
a plain path's checks before anything is copied; a malformed or unknown --resume key is one
message, before Prefect starts."""

import subprocess
import sys

import pytest

from miles_core.config import build_config
from miles_core.preflight import PreflightError, preflight
from miles_core.storage.models import ModelSourceError, materialize_model
from tests.conftest import REPO, run_env


def test_a_file_url_model_source_gets_the_checks_of_a_plain_path(tmp_path):
    folder = tmp_path / "not-a-model"
    folder.mkdir()
    (folder / "weights.bin").write_bytes(b"x" * 1024)
    for source in (str(folder), folder.as_uri()):
        cfg = build_config({"model": {"source": source}, "storage": {"work_dir": str(tmp_path / "work")}})
        with pytest.raises(PreflightError, match=f"model.source: {folder} has no config.json"):
            preflight(cfg)
        with pytest.raises(ModelSourceError, match="has no config.json"):
            materialize_model(cfg.model, tmp_path / "cache")
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())  # nothing was copied


@pytest.mark.parametrize("key, message", [("../x", "invalid run key '../x'"),
                                          ("never-ran", "cannot resume 'never-ran': no run with this key")])
def test_a_bad_resume_key_is_refused_before_prefect_starts(tmp_path, key, message):
    work = tmp_path / "work"
    done = subprocess.run([sys.executable, "-m", "flows.cli", "run", str(REPO / "configs/local.yaml"), "--resume", key,
                           "--set", f"storage.work_dir={work}"], cwd=REPO, env=run_env(), capture_output=True,
                          text=True, timeout=300)
    out = " ".join((done.stdout + done.stderr).split())
    assert done.returncode == 2 and message in out and "Traceback" not in out, out[-2000:]
    assert not [p for p in work.rglob("*") if p.is_file()]  # no Prefect database, no MLflow store, no run dir
