import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import REPO, run_env


@dataclass
class Workspace:
    dir: Path
    """This module's own directory: run dirs, logs, its MLflow database."""
    sets: list[str]
    """`--set` overrides of a run in this workspace."""
    env: dict[str, str]
    """The environment of a `miles` subprocess here (tests.conftest.run_env, the session's
    Prefect server)."""

    def miles_run(self, run_dir: Path, overrides: list[str], recipe: str = "configs/local.yaml") -> dict:
        """`miles run <recipe> --run-dir run_dir --set ...` here (this workspace's sets last);
        asserts it succeeded and returns its summary.json."""
        cmd = [sys.executable, "-m", "flows.cli", "run", str(REPO / recipe), "--run-dir", str(run_dir)]
        for override in [*overrides, *self.sets]:
            cmd += ["--set", override]
        proc = subprocess.run(cmd, cwd=REPO, env=self.env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return json.loads((run_dir / "summary.json").read_text())


@pytest.fixture(scope="module")
def isolated(shared_work_dir, prefect_api, tmp_path_factory) -> Workspace:
    """A workspace whose runs share the session's work dir (its cached stages: the recipe's
    warm-up is built once) but have their own MLflow database and registry."""
    own = tmp_path_factory.mktemp("module")
    return Workspace(own, [f"storage.work_dir={shared_work_dir}", f"tracking.tracking_uri=sqlite:///{own / 'mlflow.db'}"],
                     run_env(prefect_api))
