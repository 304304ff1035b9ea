"""The rl-posttrain flow on the Megatron backend (configs/local-megatron.yaml, CPU through the
compat layer): it learns, and the convert-checkpoint stage is cached.

One driver process runs the flow, then a flow of the conversion stage alone, which must find
the conversion in the cache, then deletes the converted directory and runs that flow again,
which must refresh its cache entry. Kept short: 60 RL steps of the recipe (its warm-up stops
at probe pass@1 0.3), so the learning check is the training reward rising and
held-out accuracy not falling; the full recipe's gain is the FSDP2 flow test's and the sweep's.
"""

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.e2e

RECIPE = REPO / "configs/local-megatron.yaml"
FAST = ["training.num_steps=60"]
MARK = "=== megatron-flow-test:"


def _manifest(work: Path) -> Path:
    (manifest,) = (work / "cache" / "megatron").glob("*/MANIFEST.json")
    return manifest


def drive(work: str, own: str, out_json: str) -> None:
    """Run in a subprocess: a flow run, a cached conversion, a refreshed one. `work` is
    the shared storage.work_dir (its cached warm-up is reused), `own` this module's directory."""
    from flows.cli import local_environment

    local_environment(work)
    import shutil

    from prefect import flow

    from flows.rl_posttrain import rl_posttrain
    from tasks.artifacts import convert_checkpoint, prepare_data, prepare_model, sft_warmup

    work_path, own_path = Path(work), Path(own)
    overrides = [f"storage.work_dir={work}", f"tracking.tracking_uri=sqlite:///{own_path / 'mlflow.db'}", *FAST]

    @flow(name="megatron-convert")
    def convert() -> dict:
        from miles_core.config import load_config

        cfg = load_config(RECIPE, overrides)
        policy = sft_warmup(cfg, prepare_model(cfg), prepare_data(cfg))  # cached
        return convert_checkpoint(cfg, policy).model_dump()

    print(f"{MARK} run 1", flush=True)
    first = rl_posttrain(str(RECIPE), overrides, run_dir=str(own_path / "run1"))
    manifest = _manifest(work_path)
    stamp = manifest.stat().st_mtime_ns
    print(f"{MARK} run 2", flush=True)  # a later flow run finds the conversion in the cache
    convert()
    reused = _manifest(work_path) == manifest and manifest.stat().st_mtime_ns == stamp
    shutil.rmtree(manifest.parent)
    print(f"{MARK} refresh", flush=True)
    refreshed = convert()
    Path(out_json).write_text(json.dumps({"first": first, "reused": reused, "refreshed": refreshed}))


@pytest.fixture(scope="module")
def runs(shared_work_dir, isolated):
    work, own = shared_work_dir, isolated.dir
    out = own / "result.json"
    code = f"from tests.e2e.test_megatron_flow import drive; drive({str(work)!r}, {str(own)!r}, {str(out)!r})"
    # one stream, so that the run markers and Prefect's log lines stay in order
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=isolated.env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=900)
    (own / "driver.log").write_text(proc.stdout)  # kept for debugging a failed assertion
    assert proc.returncode == 0, proc.stdout[-4000:]
    return work, json.loads(out.read_text()), proc.stdout


def _section(output: str, name: str) -> str:
    return output.split(f"{MARK} {name}")[1].split(MARK)[0]


def test_megatron_training_raises_heldout_accuracy(runs):
    _, result, _ = runs
    first = result["first"]
    assert first["status"] == "completed" and first["steps"] == 60
    rewards = first["reward_curve"]
    assert statistics.fmean(rewards[-10:]) >= statistics.fmean(rewards[:10]) + 0.05, rewards
    assert first["eval"]["after"] >= first["eval"]["before"], first["eval"]
    resolved = json.loads((Path(first["run_dir"]) / "config.resolved.json").read_text())
    assert resolved["training"]["backend"] == "megatron"


def test_conversion_is_cached_across_runs(runs):
    work, result, output = runs
    assert result["reused"], "the second run rewrote the converted checkpoint"
    second_run = _section(output, "run 2")
    assert "convert-checkpoint" in second_run
    cached = [line for line in second_run.splitlines() if "convert-checkpoint" in line and "Finished in state" in line]
    assert cached and all("Cached" in line for line in cached), cached


def test_deleted_conversion_is_refreshed(runs):
    work, result, output = runs
    refreshed = result["refreshed"]
    megatron_dir = Path(refreshed["megatron_dir"])
    assert refreshed["megatron_dir"] is not None and refreshed["model_dir"] != refreshed["megatron_dir"]
    assert (megatron_dir / "MANIFEST.json").is_file() and (megatron_dir / "torch_dist").is_dir()
    assert "converted " in _section(output, "refresh")
