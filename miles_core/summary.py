"""The run summary: what a finished `rl-posttrain` run hands on, as one typed model.

The flow builds it, writes `summary.json` from it and returns its JSON form; `miles run` and
`miles show` print it. The JSON keys are the ones readers of summary.json have always used.
"""

from __future__ import annotations

from typing import Any

from miles_core.storage.artifacts import Dataset, StageResult
from miles_core.tracking.redaction import redact

SUMMARY_FILE = "summary.json"
STAGES = ("prepare_model", "prepare_data", "ensure_ray", "sft_warmup", "prepare_teacher", "convert", "eval_before",
          "train", "upload", "eval_after", "register", "promote")
"""The flow's stages in order: the keys of RunSummary.timings, and what `miles plan` lists."""


class HeldOutScores(StageResult):
    before: float
    """Held-out pass@1 of the model RL started from."""
    after: float
    """Held-out pass@1 of the exported model."""
    num_prompts: int | None = None
    """Held-out prompts scored (None where the evaluator did not say, e.g. external commands)."""


class WarmupRecord(StageResult):
    sft_steps: int
    """SFT warm-up steps trained (0: none)."""
    probe_pass_at_1: float | None = None
    """Greedy pass@1 on the probe prompts at the end of the warm-up (None without a target)."""
    reached_target: bool | None = None
    """Whether warmup.target_pass_at_1 was reached (None without a target)."""


class MlflowRef(StageResult):
    tracking_uri: str
    run_id: str
    model_name: str
    """Registered model the run's export became a version of."""


class RunSummary(StageResult):
    run_key: str
    status: str
    """"completed" for a run that went through every stage."""
    run_dir: str
    eval: HeldOutScores
    eval_details: dict[str, dict[str, dict[str, Any]]]
    """{"before"|"after": {dataset: metrics and counts}} of every evaluated dataset."""
    warmup: WarmupRecord
    teacher_dir: str | None = None
    """The distillation teacher's HF directory (None without distillation)."""
    promotion: dict[str, Any]
    """The registry gate's decision (promoted, reason, version, scores)."""
    steps: int
    """RL steps of the run (all sessions)."""
    resumed_from_step: int | None
    checkpoint_uri: str
    hf_export_uri: str
    hf_export_dir: str
    model_version: str
    data: Dataset
    mlflow: MlflowRef
    reward_curve: list[float]
    """rollout/reward_mean per step, from MLflow (every session's steps)."""
    periodic_eval: dict[str, list[tuple[int, float]]]
    """{dataset: [(step, pass@1)]} of the periodic evaluations."""
    timings: dict[str, float]
    """Seconds per flow stage of this attempt."""

    def redacted(self) -> RunSummary:
        """The summary with credentials in its URIs masked: it is written, printed and returned,
        and its URIs come from the config (store, tracking, data)."""
        return RunSummary.model_validate(redact(self.model_dump(mode="json"), by_name=False))
