"""Prefect automations for runs whose worker dies (machine lost, pod evicted, OOM-killed).

A deployment's flow run emits `prefect.flow-run.heartbeat` every
PREFECT_FLOWS_HEARTBEAT_FREQUENCY seconds. Two automations act on that:

1. `miles: crash unresponsive runs`: a running flow run that misses heartbeats for
   `missed_heartbeats` periods is marked Crashed (Prefect's documented zombie detection).
2. `miles: resume crashed prod runs`: a Crashed run of rl-posttrain/prod starts a new run of
   the same deployment and recipe with `resume_from` set to the crashed run's key, so training
   continues from its latest checkpoint (and re-attaches to its driver Ray Job if that is still
   alive). The new run gets the deployment's default overrides.

`miles stack up` applies them to the stack's server; `miles stack automations` applies them to
any server PREFECT_API_URL names. Applying is idempotent: automations of the same name are
replaced.
"""

from __future__ import annotations

from datetime import timedelta

from prefect.automations import Automation
from prefect.client.schemas.objects import StateType
from prefect.events.actions import ChangeFlowRunState, RunDeployment
from prefect.events.schemas.automations import EventTrigger, Posture
from prefect.events.schemas.events import ResourceSpecification

CRASH_NAME = "miles: crash unresponsive runs"
RESUME_NAME = "miles: resume crashed prod runs"
ENDED = {"prefect.flow-run.Completed", "prefect.flow-run.Failed", "prefect.flow-run.Cancelled",
         "prefect.flow-run.Crashed"}


def crash_unresponsive_runs(heartbeat_seconds: int, missed_heartbeats: int = 3) -> Automation:
    return Automation(
        name=CRASH_NAME,
        description="Mark a flow run Crashed when its heartbeats stop (its worker or machine died).",
        trigger=EventTrigger(
            after={"prefect.flow-run.heartbeat"},
            expect={"prefect.flow-run.heartbeat", *ENDED},
            match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=timedelta(seconds=heartbeat_seconds * missed_heartbeats),
        ),
        actions=[ChangeFlowRunState(state=StateType.CRASHED, name="Crashed",
                                    message=f"no heartbeat for {missed_heartbeats} periods of {heartbeat_seconds} s")],
    )


def resume_crashed_prod_runs(deployment_name: str = "prod") -> Automation:
    # The crashed run's own key: its resume_from when it was itself a resume, else its id.
    run_key = "{{ flow_run.parameters.resume_from or flow_run.id }}"
    return Automation(
        name=RESUME_NAME,
        description="Start a resume_from run of the deployment whose run crashed.",
        trigger=EventTrigger(
            expect={"prefect.flow-run.Crashed"},
            match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
            match_related=ResourceSpecification({"prefect.resource.role": "deployment",
                                                 "prefect.resource.name": deployment_name}),
            posture=Posture.Reactive,
            threshold=1,
        ),
        # overrides stay the deployment's defaults: the server validates JSON parameters before
        # rendering templates, so a list cannot be templated. Scheduled prod runs use the
        # defaults anyway; a run started with custom overrides is resumed by hand.
        actions=[RunDeployment(source="inferred", parameters={
            "config_path": "{{ flow_run.parameters.config_path }}", "resume_from": run_key})],
    )


def apply(heartbeat_seconds: int) -> list[str]:
    """Create (or replace) both automations on the current PREFECT_API_URL; returns their ids."""
    ids = []
    for automation in (crash_unresponsive_runs(heartbeat_seconds), resume_crashed_prod_runs()):
        while (existing := _read(automation.name)) is not None:
            existing.delete()
        ids.append(str(automation.create().id))
    return ids


def apply_to_server(api_url: str, heartbeat_seconds: int) -> None:
    """apply() against the Prefect server at api_url, reported on the console."""
    import time

    from prefect.settings import PREFECT_API_URL, temporary_settings
    from rich.console import Console

    started = time.time()
    with temporary_settings({PREFECT_API_URL: api_url}):
        apply(heartbeat_seconds)
    Console(stderr=True).print(f"[green]✓[/] automations applied in {time.time() - started:.1f} s  "
                               f"({CRASH_NAME}; {RESUME_NAME})")


def _read(name: str) -> Automation | None:
    try:
        return Automation.read(name=name)
    except ValueError:  # "Automation with name ... not found"
        return None
