"""Which failures a retry can fix.

A retried training task resumes from the latest checkpoint, so retrying is right only when
the failure came from outside the run's inputs: a lost actor or node, a network or storage
outage, a killed job. A bad config, a missing file, a NaN or a shape mismatch fails the same
way every time and must fail fast. Library errors say which they are by subclassing
`InfrastructureError`; third-party ones (Ray, botocore, aiohttp) are known by class name so
that this module imports none of them.
"""

from __future__ import annotations

# Third-party and built-in classes whose instances are infrastructure failures.
EXTERNAL_INFRASTRUCTURE_ERRORS = frozenset({
    # ray.exceptions
    "RayActorError", "ActorDiedError", "ActorUnavailableError", "NodeDiedError", "ObjectLostError",
    "OwnerDiedError", "WorkerCrashedError", "RaySystemError", "GetTimeoutError",
    # built-ins, botocore, aiohttp
    "ConnectionError", "TimeoutError", "ConnectTimeoutError", "ReadTimeoutError", "EndpointConnectionError",
    "ServerDisconnectedError", "ClientOSError",
})


class InfrastructureError(Exception):
    """Something the run depends on failed (engine, actor, job, store, network); a retry,
    which resumes from the latest checkpoint, can succeed."""


def is_retryable(exc: BaseException) -> bool:
    """Whether a retry can fix exc (see the module docstring)."""
    return is_retryable_class(type(exc).__mro__)


def is_retryable_class(mro: tuple[type, ...] | list[str]) -> bool:
    """The same test on a class's MRO, as classes or as names (a Ray Job driver reports the
    names of what it raised; the watching task decides)."""
    names = {cls if isinstance(cls, str) else cls.__name__ for cls in mro}
    return InfrastructureError.__name__ in names or bool(names & EXTERNAL_INFRASTRUCTURE_ERRORS)
