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
