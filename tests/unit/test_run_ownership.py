"""A run directory is one run's: a new run refuses a directory holding another run's files
before it writes anything or starts a run anywhere."""

import pytest

from flows.rl_posttrain import rl_posttrain
from miles_core.tracking import runs as tracking
from tests.conftest import REPO

RECIPE = str(REPO / "configs/local.yaml")


def test_a_new_run_refuses_a_run_dir_holding_another_runs_files(tmp_path, monkeypatch):
    theirs = tmp_path / "theirs"
    (theirs / "checkpoints" / "step_000002").mkdir(parents=True)
    (theirs / "RUN_KEY").write_text("their-run")
    (theirs / "summary.json").write_text('{"run_key": "their-run", "steps": 2}')
    before = {p: p.read_bytes() for p in theirs.rglob("*") if p.is_file()}

    def started(*args, **kwargs):
        raise AssertionError("a new run started in another run's directory")
    monkeypatch.setattr(tracking, "start_or_attach_run", started)
    overrides = [f"storage.work_dir={tmp_path / 'work'}", f"tracking.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}"]
    with pytest.raises(ValueError, match=r"belongs to run 'their-run', not to run '[^']+'.*--resume their-run"):
        rl_posttrain.fn(RECIPE, overrides, run_dir=str(theirs))
    assert {p: p.read_bytes() for p in theirs.rglob("*") if p.is_file()} == before
