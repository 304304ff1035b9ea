"""Evaluation: held-out pass@k through the same engine code that generates rollouts (`core`, also
external eval commands and the metric names), evaluation every N steps during training (`periodic`,
in the driver process), and the before/after reports and plots (`reports`, in the flow's evaluate
and publish tasks).
"""
