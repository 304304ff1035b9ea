"""Metric names that one module logs and another reads back (MLflow keys, history rows): the
producer and every reader use these constants, so a rename cannot leave a reader behind. Names
only one module ever sees stay where they are logged."""

REWARD_MEAN = "rollout/reward_mean"
"""Mean reward of the step's samples (the flow's reward curve, the driver's progress line)."""
TRAIN_LOSS = "train/loss"
"""The step's policy loss (value loss alone for a critic-only update); must be finite."""
TRAIN_SECONDS = "time/train_seconds"
"""Wall seconds of the step's update, the tokens-per-second denominators' source."""
STEP_SECONDS = "time/step_seconds"
"""Wall seconds of the whole step (rollout, update, sync)."""
SYNC_SECONDS = "weights/sync_seconds"
"""Wall seconds of the step's weight sync, whatever the transport."""
PERIODIC_EVAL_SECONDS = "time/periodic_eval_seconds"
"""Seconds a periodic evaluation took, logged beside its pass@k (time-to-accuracy subtracts it)."""
ASYNC_DROPPED_TOKENS = "async/dropped_tokens"
"""Response tokens of the batches the fully async loop dropped or regenerated as stale
(max_weight_staleness), counted from the session's start."""
PARTIAL_TOKENS_THROWN_AWAY = "rollout/partial_tokens_thrown_away"
"""Response tokens of partial groups thrown away as too stale (rollout.partial), over the run."""
TOKENS_WASTED = "rollout/tokens_wasted"
"""Generated tokens never trained on: ASYNC_DROPPED_TOKENS + PARTIAL_TOKENS_THROWN_AWAY (0 for
sync and one-step-off, whose every batch trains). The long-tail bench compares loops by it."""
TOKENS_UNUSED_AT_END = "rollout/tokens_unused_at_end"
"""Response tokens the fully async producer had generated ahead when the run reached
training.num_steps: its batches made and not trained and, with rollout.partial, its pool's groups
(finished or not). Logged once, on the last step; not in TOKENS_WASTED, since a run resumed with
more steps trains the partial ones from its checkpoint."""

# ---- evaluation ------------------------------------------------------------------------------
# One scheme: eval/<phase>/<dataset>/<metric>, the metric's "@" spelled "_at_" (MLflow names
# cannot hold "@"): eval/before/heldout/pass_at_1, eval/periodic/gsm8k/avg_at_4.
HELDOUT = "heldout"
"""The dataset name of the recipe's held-out set (data.eval_path or the built-in split)."""
BEFORE, AFTER, PERIODIC = "before", "after", "periodic"
"""Eval phases: the model RL starts from, the exported model, every eval.interval_steps."""


def eval_metric_name(phase: str, dataset: str, metric: str) -> str:
    """The MLflow name of one eval metric ("pass@1", "avg@4", ...) of one dataset in one phase."""
    return f"eval/{phase}/{dataset}/{metric.replace('@', '_at_')}"


def split_eval_metric_name(name: str) -> tuple[str, str, str] | None:
    """(phase, dataset, metric as "pass@1") of an eval_metric_name; None for any other name."""
    head, _, rest = name.partition("/")
    phase, _, rest = rest.partition("/")
    dataset, _, metric = rest.rpartition("/")
    if head != "eval" or not (phase and dataset and metric):
        return None
    return phase, dataset, metric.replace("_at_", "@")


BEFORE_HELDOUT_PASS_AT_1 = eval_metric_name(BEFORE, HELDOUT, "pass@1")
"""Held-out pass@1 (fraction of prompts, 0 to 1) of the model RL starts from, at step 0."""
AFTER_HELDOUT_PASS_AT_1 = eval_metric_name(AFTER, HELDOUT, "pass@1")
"""Held-out pass@1 (fraction, 0 to 1) of the exported model: the score the registry gate compares."""
PERIODIC_HELDOUT_PASS_AT_1 = eval_metric_name(PERIODIC, HELDOUT, "pass@1")
"""Held-out pass@1 (fraction, 0 to 1) every eval.interval_steps, at the step whose weights it scored."""

DEPRECATED_EVAL_ALIASES: dict[str, str] = {
    "eval/before_pass_at_1": BEFORE_HELDOUT_PASS_AT_1,
    "eval/after_pass_at_1": AFTER_HELDOUT_PASS_AT_1,
}
"""Deprecated flat name -> its canonical name. Still logged beside the canonical one (same value,
same step) so that dashboards on the old names keep working; removed in the release after 0.1
(docs/flow.md, "Deprecated metric names")."""


def with_deprecated_aliases(metrics: dict[str, float]) -> dict[str, float]:
    """metrics plus, for each canonical name in it that has a deprecated alias, the alias."""
    return metrics | {old: metrics[new] for old, new in DEPRECATED_EVAL_ALIASES.items() if new in metrics}
