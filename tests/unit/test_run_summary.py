"""The run summary as a typed hand-off: summary.json keeps its readers' keys, its URIs are
redacted, and `miles show` prints it back."""

import json

from typer.testing import CliRunner

from flows.cli import app
from miles_core.storage.artifacts import Dataset
from miles_core.summary import HeldOutScores, MlflowRef, RunSummary, WarmupRecord

# what the e2e tests, bench/seed_sweep.py and users' scripts read from summary.json
READERS_KEYS = {"run_key", "status", "run_dir", "eval", "eval_details", "warmup", "teacher_dir", "promotion", "steps",
                "resumed_from_step", "checkpoint_uri", "hf_export_uri", "hf_export_dir", "model_version", "data",
                "mlflow", "reward_curve", "periodic_eval", "timings"}


def summary(tmp_path) -> RunSummary:
    return RunSummary(
        run_key="abc", status="completed", run_dir=str(tmp_path),
        eval=HeldOutScores(before=0.3, after=0.75, num_prompts=200),
        eval_details={"before": {"heldout": {"pass@1": 0.3}}, "after": {"heldout": {"pass@1": 0.75}}},
        warmup=WarmupRecord(sft_steps=310, probe_pass_at_1=0.305, reached_target=True),
        promotion={"promoted": True, "reason": "first champion", "version": "1"}, steps=200, resumed_from_step=None,
        checkpoint_uri="s3://ak:sk-secret@store.example/runs/abc/checkpoints/step_000200",
        hf_export_uri="s3://store.example/runs/abc/hf_export", hf_export_dir=str(tmp_path / "hf"),
        model_version="1", data=Dataset(train_path="/d/train.jsonl", eval_path="/d/eval.jsonl"),
        mlflow=MlflowRef(tracking_uri="http://user:pw@mlflow.example", run_id="r1", model_name="m"),
        reward_curve=[-0.5, 0.1], periodic_eval={"heldout": [(20, 0.5), (40, 0.6)]}, timings={"train": 85.4})


def test_summary_json_keeps_its_readers_keys_and_hides_credentials(tmp_path):
    written = json.loads(summary(tmp_path).redacted().model_dump_json())
    assert set(written) == READERS_KEYS
    assert written["eval"] == {"before": 0.3, "after": 0.75, "num_prompts": 200}
    assert written["periodic_eval"] == {"heldout": [[20, 0.5], [40, 0.6]]}
    text = json.dumps(written)
    assert "sk-secret" not in text and ":pw@" not in text and "store.example/runs/abc" in text


def test_show_prints_a_summary_back(tmp_path):
    (tmp_path / "summary.json").write_text(summary(tmp_path).redacted().model_dump_json(indent=1))
    result = CliRunner().invoke(app, ["show", str(tmp_path)], terminal_width=200)
    out = " ".join(result.output.split())
    assert result.exit_code == 0, result.output
    assert "0.300 -> 0.750" in out and "310 steps, probe pass@1 0.305" in out and "models:/m/1 (@champion" in out


def test_the_flow_times_exactly_the_listed_stages_in_order():
    """summary.json's timings and `miles plan`'s stage list come from STAGES: the flow must time
    each of them, in that order, and nothing else."""
    import re
    from pathlib import Path

    from miles_core.summary import STAGES

    source = (Path(__file__).resolve().parents[2] / "flows" / "rl_posttrain.py").read_text()
    assert tuple(re.findall(r'with timer\("([a-z_]+)"\)', source)) == STAGES
