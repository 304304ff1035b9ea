"""MLflow tracking: one MLflow run per run key, exactly-once metric steps, model registry.

MLflow is imported where it is used: the training driver imports this module and runs without
MLflow when its spec names no MLflow run (a GPU host with only the trainer's stack)."""

from __future__ import annotations

import itertools
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles_core.config import RunConfig
from miles_core.metrics import STEP_SECONDS
from miles_core.storage.checkpoint import check_run_key, step_dir_name
from miles_core.tracking.redaction import redact, redact_text
from miles_core.types import EvalResult

if TYPE_CHECKING:
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

RUN_KEY_TAG = "miles.run_key"
CONFIG_ARTIFACT = "config/resolved.json"
CONFIG_LOGGED_TAG = "miles.config_logged"


def tracking_uri(cfg: RunConfig) -> str:
    if cfg.tracking.tracking_uri:
        return cfg.tracking.tracking_uri
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    return f"sqlite:///{cfg.storage.work_path / 'mlflow.db'}"


def client_for(uri: str) -> MlflowClient:
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def _has_store(uri: str) -> bool:
    """False for a local SQLite store not created yet: looking into it would create it, and a
    lookup (a resume check, a failure hook) must not write a database."""
    return not uri.startswith("sqlite:///") or Path(uri[len("sqlite:///"):]).is_file()


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """{dotted.name: text} of a config tree, redacted (what MLflow params may show)."""
    flat = {}
    for key, value in redact(tree).items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = str(value)[:6000]
    return flat


def _run_of(client: MlflowClient, experiment_id: str, run_key: str) -> str | None:
    check_run_key(run_key)  # it is spliced into a filter string
    found = client.search_runs([experiment_id], filter_string=f"tags.`{RUN_KEY_TAG}` = '{run_key}'", max_results=1)
    return found[0].info.run_id if found else None


def start_or_attach_run(cfg: RunConfig, run_key: str, tags: dict[str, str]) -> tuple[str, str]:
    """The MLflow run of this run key: attached if it exists (resume), else created with
    params logged once. Returns (tracking uri, MLflow run id)."""
    uri = tracking_uri(cfg)
    client = client_for(uri)
    experiment = client.get_experiment_by_name(cfg.tracking.experiment_name)
    if experiment is None:
        artifact_root = None
        if uri.startswith("sqlite:"):
            artifact_root = (cfg.storage.work_path / "mlartifacts").as_uri()
        experiment_id = client.create_experiment(cfg.tracking.experiment_name, artifact_location=artifact_root)
    else:
        experiment_id = experiment.experiment_id
    if (run_id := _run_of(client, experiment_id, run_key)) is not None:
        client.update_run(run_id, status="RUNNING")  # a resume of a run that ended FAILED
        if CONFIG_LOGGED_TAG not in client.get_run(run_id).data.tags:  # its creator died before logging it
            _log_config(client, run_id, cfg)
        return uri, run_id
    run = client.create_run(experiment_id, run_name=run_key,
                            tags={RUN_KEY_TAG: run_key, "miles.config_digest": cfg.digest(),
                                  **{k: redact_text(v) for k, v in tags.items()}})
    _log_config(client, run.info.run_id, cfg)
    return uri, run.info.run_id


def _log_config(client: MlflowClient, run_id: str, cfg: RunConfig) -> None:
    """The flattened config as params and as one artifact, each only where not logged yet
    (MLflow refuses to change a param; a resume's overrides must not rewrite the creator's
    file), then a tag saying so, which a later attach looks for."""
    from mlflow.entities import Param

    flat = flatten(cfg.model_dump(mode="json"))
    logged = client.get_run(run_id).data.params
    params = [Param(k, v) for k, v in flat.items() if k not in logged]
    for start in range(0, len(params), 100):
        client.log_batch(run_id, params=params[start : start + 100])
    if CONFIG_ARTIFACT not in [a.path for a in client.list_artifacts(run_id, CONFIG_ARTIFACT.rsplit("/", 1)[0])]:
        client.log_dict(run_id, flat, CONFIG_ARTIFACT)  # the same redacted values, as one file
    client.set_tag(run_id, CONFIG_LOGGED_TAG, "true")


def recent_run_keys(cfg: RunConfig, limit: int = 5) -> list[str]:
    """The run keys of the experiment's latest runs, newest first (for error messages)."""
    uri = tracking_uri(cfg)
    if not _has_store(uri):
        return []
    client = client_for(uri)
    experiment = client.get_experiment_by_name(cfg.tracking.experiment_name)
    if experiment is None:
        return []
    runs = client.search_runs([experiment.experiment_id], max_results=limit, order_by=["attributes.start_time DESC"])
    return [run.data.tags[RUN_KEY_TAG] for run in runs if RUN_KEY_TAG in run.data.tags]


def find_run(cfg: RunConfig, run_key: str) -> tuple[str, str] | None:
    """(tracking uri, MLflow run id) of a run key, if its run was created."""
    uri = tracking_uri(cfg)
    if not _has_store(uri):
        return None
    client = client_for(uri)
    experiment = client.get_experiment_by_name(cfg.tracking.experiment_name)
    run_id = _run_of(client, experiment.experiment_id, run_key) if experiment else None
    return (uri, run_id) if run_id else None


def check_resumable_run(cfg: RunConfig, run_key: str) -> None:
    """ValueError unless run_key is a well-formed key of a run in this config's MLflow
    experiment (a lookup only: nothing is created)."""
    check_run_key(run_key)
    if find_run(cfg, run_key) is None:
        known = ", ".join(recent_run_keys(cfg)) or "none"
        raise ValueError(f"cannot resume {run_key!r}: no run with this key in MLflow experiment "
                         f"{cfg.tracking.experiment_name!r} at {redact_text(tracking_uri(cfg))} (latest run keys: "
                         f"{known}); check the key (the run's RUN_KEY file or summary.json has it), or drop --resume "
                         "(resume_from) to start a new run")


@contextmanager
def system_metrics(uri: str | None, run_id: str | None, interval_seconds: float):
    """MLflow's system metrics (system/cpu_utilization_percentage, memory, disk, network, and
    GPU ones where a GPU is visible) sampled while the block runs; steps continue on resume.
    Nothing without a run or with interval_seconds 0."""
    if interval_seconds <= 0 or not run_id:
        yield
        return
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    monitor = SystemMetricsMonitor(run_id, sampling_interval=interval_seconds, resume_logging=True, tracking_uri=uri)
    monitor.start()
    try:
        yield
    finally:
        monitor.finish()


class MetricsLogger:
    """Buffers per-step metrics and writes them before each checkpoint is written.

    A complete checkpoint's steps are then in MLflow, since a resume never recomputes them.
    Steps at or below the highest step already in MLflow are skipped, so a resumed attempt
    that recomputes steps (a kill between the flush and a complete checkpoint) never writes
    them twice and never leaves a gap. Buffering until then lets a periodic evaluation that
    finishes a few steps late still land at its own step.
    """

    def __init__(self, uri: str, run_id: str, probe_metric: str = STEP_SECONDS):
        self.client, self.run_id, self.probe_metric = client_for(uri), run_id, probe_metric
        history = self.client.get_metric_history(run_id, probe_metric)
        self.logged_through = max((m.step for m in history), default=0)
        self.pending: list[Metric] = []

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if step <= self.logged_through:
            return
        from mlflow.entities import Metric

        now = int(1000 * time.time())
        self.pending.extend(Metric(k, float(v), now, step) for k, v in metrics.items())

    def flush(self) -> None:
        for batch in self._batches():
            self.client.log_batch(self.run_id, metrics=batch)
        if self.pending:
            self.logged_through = max(m.step for m in self.pending)
        self.pending = []

    def _batches(self, limit: int | None = None) -> list[list[Metric]]:
        """The pending metrics in step order, each step's probe last, in batches of whole steps
        (limit: MLflow's metrics per log_batch). A kill between batches then leaves the probe's
        highest step with all its metrics written, and a resume rewrites only steps that are
        not. A step over the limit is split, probe last: a kill between its pieces leaves the
        step unlogged, and its first pieces are written again on resume."""
        from mlflow.utils.validation import MAX_METRICS_PER_BATCH

        limit = limit or MAX_METRICS_PER_BATCH
        ordered = sorted(self.pending, key=lambda m: (m.step, m.key == self.probe_metric))
        batches: list[list[Metric]] = []
        for _, step_metrics in itertools.groupby(ordered, key=lambda m: m.step):
            group = list(step_metrics)
            if batches and len(batches[-1]) + len(group) <= limit:
                batches[-1].extend(group)
            else:
                batches.extend(group[start : start + limit] for start in range(0, len(group), limit))
        return batches


def metric_history(uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    """(step, value) of a run's metric in step order, the latest value where a step has several.
    Across resumes this is the whole run, where a driver session sees only its own steps."""
    latest: dict[int, float] = {}
    for m in sorted(client_for(uri).get_metric_history(run_id, key), key=lambda m: (m.step, m.timestamp)):
        latest[m.step] = m.value
    return sorted(latest.items())


def log_eval_file(uri: str, run_id: str, phase: str, result: EvalResult) -> None:
    """The held-out result of a phase, examples included, as the run artifact eval/<phase>.json
    (its metrics go to MLflow through miles_core.evaluation.reports.log_eval_metrics)."""
    client_for(uri).log_dict(run_id, result.to_json(), f"eval/{phase}.json")


def register_model(uri: str, run_id: str, name: str, hf_export_dir: str, tags: dict[str, str], *,
                   step: int) -> str:
    """Log the HF export of `step` as run artifacts, register them as a model version and
    point the `candidate` alias at it.

    Each step's export has its own artifact path, so a resumed run that trains further never
    changes the weights of the version it registered before. A retry or resume that already
    registered this run's step gets that version back instead of a duplicate."""
    from mlflow.exceptions import MlflowException

    client = client_for(uri)
    artifact_path = f"hf_export/{step_dir_name(step)}"
    source = f"{client.get_run(run_id).info.artifact_uri}/{artifact_path}"
    registered = [v for v in client.search_model_versions(f"run_id = '{check_run_key(run_id)}'")
                  if v.name == name and v.source == source]
    if registered:
        version = registered[0]
    else:
        client.log_artifacts(run_id, hf_export_dir, artifact_path=artifact_path)
        try:
            client.get_registered_model(name)
        except MlflowException:
            client.create_registered_model(name, description="HF exports of rl-posttrain runs")
        version = client.create_model_version(name, source=source, run_id=run_id,
                                              tags={k: redact_text(v) for k, v in tags.items()})
    client.set_registered_model_alias(name, "candidate", version.version)
    return str(version.version)


def artifact_uri(uri: str, run_id: str, path: str) -> str:
    """Where a run artifact lives (what a registry tag links to)."""
    return f"{client_for(uri).get_run(run_id).info.artifact_uri}/{path}"


def finish(uri: str, run_id: str, status: str) -> None:
    client_for(uri).set_terminated(run_id, status=status)
