"""Cached artifact stages across work dirs that share one object store (their Prefect results).

The cached stages persist their results in the object store, which runs of many work dirs can
share, while each run's artifacts live under its own `storage.work_dir`. A cached result is a
set of absolute paths, so a run must never be handed another work dir's paths (a CI run once
trained from a deleted directory this way), and an entry whose files were deleted must be rebuilt.
"""

import json
import os
import subprocess
import sys

from tests.conftest import REPO, run_env

CHILD = r"""
import json, shutil, sys
from pathlib import Path
from prefect import flow
from miles_core.config import RunConfig
from tasks.artifacts import prepare_data

work_a, work_b, store = sys.argv[1], sys.argv[2], sys.argv[3]

@flow(name="artifact-cache-test")
def check() -> dict:
    def data(work):
        return prepare_data(RunConfig.model_validate({"storage": {"work_dir": work, "object_store_uri": store}}))
    first_a, first_b = data(work_a), data(work_b)
    again_a = data(work_a)
    Path(again_a.train_path).unlink()
    rebuilt_a = data(work_a)
    return {"first_a": first_a.model_dump(), "first_b": first_b.model_dump(), "again_a": again_a.model_dump(),
            "rebuilt_a": rebuilt_a.model_dump()}

print("RESULT " + json.dumps(check()))
"""


def _child_env(prefect_home) -> dict:
    return run_env(PREFECT_HOME=str(prefect_home), PREFECT_SERVER_ANALYTICS_ENABLED="false",
                   PREFECT_RESULTS_PERSIST_BY_DEFAULT="false")


def test_each_work_dir_gets_its_own_artifacts_and_deleted_files_are_rebuilt(tmp_path):
    work_a, work_b = tmp_path / "a", tmp_path / "b"
    log = tmp_path / "child.log"
    with log.open("w") as out:
        proc = subprocess.run([sys.executable, "-c", CHILD, str(work_a), str(work_b), (tmp_path / "store").as_uri()],
                              cwd=REPO,
                              env=_child_env(tmp_path / "shared-prefect"), stdout=out,
                              stderr=subprocess.STDOUT, timeout=300)
    output = log.read_text()
    assert proc.returncode == 0, output[-4000:]
    result = json.loads(output.split("RESULT ", 1)[1].splitlines()[0])
    for name, work in [("first_a", work_a), ("first_b", work_b), ("rebuilt_a", work_a)]:
        for path in result[name].values():
            assert path.startswith(str(work.resolve()) + "/"), (name, path)
    assert result["again_a"] == result["first_a"]  # a cache hit for the same work dir
    assert all(os.path.isfile(p) for p in result["rebuilt_a"].values())
    assert output.count("Cached(type=COMPLETED)") >= 1, output[-4000:]
    # the results live in the shared object store, one record per (dataset, work dir)
    records = sorted(p.name for p in (tmp_path / "store" / "prefect-results").iterdir())
    assert len(records) == 2 and all(name.startswith("data-") for name in records), records
    assert not (tmp_path / "shared-prefect" / "storage").exists()


def test_local_environment_refuses_a_prefect_imported_with_other_settings(tmp_path):
    code = f"import prefect; from flows.cli import local_environment; local_environment({str(tmp_path)!r})"
    env = _child_env(tmp_path / "unused")
    env.pop("PREFECT_HOME")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**env, "HOME": str(tmp_path)},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "Prefect was imported before local_environment" in proc.stderr
