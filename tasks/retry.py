"""Prefect's retry condition, from the library's rule (miles_core.errors)."""

from __future__ import annotations

from miles_core.errors import is_retryable


def retry_if_retryable(task, task_run, state) -> bool:
    """retry_condition_fn: retry only failures a retry can fix (miles_core.errors.is_retryable)."""
    try:
        state.result()
    except Exception as exc:  # noqa: BLE001 - classifying the failure is the point
        return is_retryable(exc)
    return False
