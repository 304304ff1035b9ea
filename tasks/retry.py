"""Which failures a retry can fix: infrastructure (lost actors/nodes, network, storage 5xx),
never a bad config, a missing file, or a NaN."""

from __future__ import annotations

INFRA_ERROR_NAMES = {
    "RayActorError", "ActorDiedError", "ActorUnavailableError", "NodeDiedError", "ObjectLostError",
    "OwnerDiedError", "WorkerCrashedError", "RaySystemError", "GetTimeoutError",
    "ConnectionError", "TimeoutError", "ConnectTimeoutError", "ReadTimeoutError", "EndpointConnectionError",
    "UploadVerificationError", "ServerDisconnectedError", "EngineError", "NoHealthyEngine", "ClientOSError",
}


def is_infrastructure_error(exc: BaseException) -> bool:
    """Matched by class name (anywhere in the MRO) so that Ray, botocore and aiohttp need
    not be imported here."""
    return names_infrastructure_error([cls.__name__ for cls in type(exc).__mro__])


def names_infrastructure_error(mro_names: list[str]) -> bool:
    """The same test on an exception known only by its class names (a Ray Job driver's record)."""
    return bool(set(mro_names) & INFRA_ERROR_NAMES)


def retry_infrastructure_only(task, task_run, state) -> bool:
    """Prefect retry_condition_fn: retry only when the failure is an infrastructure error."""
    try:
        state.result()
    except Exception as exc:  # noqa: BLE001 - classifying the failure is the point
        return is_infrastructure_error(exc)
    return False
