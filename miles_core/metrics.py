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
