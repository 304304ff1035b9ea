"""Prefect's retry condition, from the library's rule (miles_core.errors)."""

from __future__ import annotations

from miles_core.errors import is_retryable


def retry_if_retryable(task, task_run, state) -> bool:
    """retry_condition_fn: retry only failures a retry can fix (miles_core.errors.is_retryable),
    never one a termination signal caused: the run was told to stop."""
    try:
        state.result()
    except Exception as exc:  # noqa: BLE001 - classifying the failure is the point
        return is_retryable(exc) and termination_signal_in(exc) is None
    return False


def termination_signal_in(exc: BaseException) -> int | None:
    """The signal number of a Prefect TerminationSignal that caused `exc`, if one did.

    Prefect's SIGTERM handler raises TerminationSignal wherever the main thread is; raised inside
    ray.get (Ray runs Python signal handlers from its C++ wait loop) it comes out wrapped in a
    SystemError, so the flow fails with that instead of crashing and never hands the signal on.
    The run was still told to stop: it must exit as a stopped run, not as a failed one.
    """
    from prefect.exceptions import TerminationSignal

    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, TerminationSignal):
            return exc.signal
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None
