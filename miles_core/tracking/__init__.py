"""Tracking: MLflow runs (one per run key, exactly-once metric steps, eval results, system metrics),
the model registry's eval-gated promotion, and redaction (what counts as a secret and how it is
hidden before anything is logged or written). Used by the driver process (metrics) and the flow's
tasks (runs, registration, promotion); MLflow is imported only where it is used.
"""
