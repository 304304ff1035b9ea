from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import run_env


@dataclass
class Workspace:
    dir: Path
    """This module's own directory: run dirs, logs, its MLflow database."""
    sets: list[str]
    """`--set` overrides of a run in this workspace."""
    env: dict[str, str]
    """The environment of a `miles` subprocess here (tests.conftest.run_env, the session's
    Prefect server)."""


@pytest.fixture(scope="module")
def isolated(shared_work_dir, prefect_api, tmp_path_factory) -> Workspace:
    """A workspace whose runs share the session's work dir (its cached stages: the recipe's
    warm-up is built once) but have their own MLflow database and registry."""
    own = tmp_path_factory.mktemp("module")
    return Workspace(own, [f"storage.work_dir={shared_work_dir}", f"tracking.tracking_uri=sqlite:///{own / 'mlflow.db'}"],
                     run_env(prefect_api))
