from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass
class Workspace:
    dir: Path
    """This module's own directory: run dirs, logs, its MLflow database."""
    sets: list[str]
    """`--set` overrides of a run in this workspace."""


@pytest.fixture(scope="session")
def e2e_work_dir(tmp_path_factory) -> Path:
    """The storage.work_dir of every e2e run: the first run of a recipe builds its cached
    stages (model, data, SFT warm-up, conversion) and later runs reuse them, as runs on one
    machine do. Each module keeps its own run dirs and MLflow database (`isolated`)."""
    return tmp_path_factory.mktemp("e2e-work")


@pytest.fixture(scope="module")
def isolated(e2e_work_dir, tmp_path_factory) -> Workspace:
    """A workspace whose runs share the cached stages but have their own MLflow database and
    registry."""
    own = tmp_path_factory.mktemp("module")
    return Workspace(own, [f"storage.work_dir={e2e_work_dir}", f"tracking.tracking_uri=sqlite:///{own / 'mlflow.db'}"])
