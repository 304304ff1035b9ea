"""examples/minimal_grpo.py, the newcomer's first read, runs end to end with tiny settings and
never imports Prefect or Ray (both are installed here, so an import anywhere on its path,
miles_core's modules included, would show in sys.modules)."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.conftest import REPO, run_env

EXAMPLE = REPO / "examples" / "minimal_grpo.py"
# Small enough for seconds on 2 CPU cores; still takes every path: probe checks (and their
# weight pushes) during the warm-up, RL steps with a push each, held-out eval before and after.
TINY = ["--steps", "2", "--set", "warmup.sft_steps=6", "--set", "warmup.check_interval_steps=3",
        "--set", "warmup.batch_size=16", "--set", "warmup.num_probe_prompts=8",
        "--set", "rollout.num_prompts_per_step=4", "--set", "rollout.num_samples_per_prompt=4",
        "--set", "data.builtin.num_train=64", "--set", "data.builtin.num_eval=16"]
# The example runs as __main__ in a fresh interpreter, which then reports what it imported.
RUNNER = """
import runpy, sys
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
print("orchestrators:", sorted({m.split(".")[0] for m in sys.modules} & {"prefect", "ray"}))
"""
RESULT = re.compile(r"^held-out pass@1 (\S+) -> (\S+)$", re.MULTILINE)


def test_minimal_example_runs_without_orchestrators(tmp_path):
    proc = subprocess.run([sys.executable, "-c", RUNNER, str(EXAMPLE), "--work-dir", str(tmp_path), "--seed", "0",
                           *TINY], capture_output=True, text=True, timeout=300, env=run_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "orchestrators: []" in proc.stdout, proc.stdout
    assert re.search(r"^SFT warm-up: 6 steps, ", proc.stdout, re.MULTILINE), proc.stdout
    assert len(re.findall(r"^step \d+: reward ", proc.stdout, re.MULTILINE)) == 2, proc.stdout
    found = RESULT.findall(proc.stdout)
    assert len(found) == 1, proc.stdout
    before, after = map(float, found[0])
    assert 0.0 <= before <= 1.0 and 0.0 <= after <= 1.0, found
