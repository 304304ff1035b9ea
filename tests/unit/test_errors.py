"""The retry rule: infrastructure failures are retried, input and programming errors never."""

from __future__ import annotations

import pytest

from miles_core.driver.ray_jobs import DriverJobFailed, DriverJobLost, DriverStalled
from miles_core.engines.sglang.client import EngineError
from miles_core.errors import InfrastructureError, is_retryable, is_retryable_class
from miles_core.rollout.router import NoHealthyEngine
from miles_core.storage.object_store import UploadVerificationError
from miles_core.storage.uploads import StoreUnavailable, UploadFailed


class ActorDiedError(Exception):
    """Stands for ray.exceptions.ActorDiedError, known by name only."""


@pytest.mark.parametrize("exc", [DriverStalled("x"), DriverJobLost("x"), EngineError("x"), NoHealthyEngine("x"),
                                 StoreUnavailable("x"), UploadVerificationError("x"), ActorDiedError(),
                                 ConnectionResetError(), TimeoutError()])
def test_infrastructure_failures_are_retried(exc):
    assert is_retryable(exc)
    assert is_retryable_class([cls.__name__ for cls in type(exc).__mro__])


@pytest.mark.parametrize("exc", [DriverJobFailed("x"), UploadFailed("403"), ValueError("bad config"),
                                 FileNotFoundError("data.jsonl"), FloatingPointError("nan"), RuntimeError("shape")])
def test_input_and_programming_errors_fail_fast(exc):
    assert not is_retryable(exc)
    assert not is_retryable_class([cls.__name__ for cls in type(exc).__mro__])


def test_library_errors_need_not_subclass_builtins():
    assert not issubclass(DriverStalled, TimeoutError) and issubclass(DriverStalled, InfrastructureError)


def test_a_failure_a_termination_signal_caused_is_never_retried():
    """SIGTERM inside ray.get surfaces wrapped (e.g. as an engine that failed to start): the task
    must not retry into more training, whatever the wrapper's class says."""
    from prefect.exceptions import TerminationSignal

    from tasks.retry import retry_if_retryable

    class FailedState:
        def __init__(self, exc):
            self.exc = exc

        def result(self):
            raise self.exc

    def start_engine():
        try:
            raise TerminationSignal(signal=15)
        except TerminationSignal as signal_exc:
            try:
                raise SystemError("error return without exception set") from signal_exc
            except SystemError:
                raise InfrastructureError("engine failed to start") from None

    with pytest.raises(InfrastructureError) as caught:
        start_engine()
    wrapped = caught.value
    assert not retry_if_retryable(None, None, FailedState(wrapped))
    assert retry_if_retryable(None, None, FailedState(InfrastructureError("engine failed to start")))
