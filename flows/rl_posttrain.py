"""The `rl-posttrain` flow: model -> data -> warm-up -> convert -> Ray -> train -> publish -> eval."""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.logging.loggers import flow_run_logger
from prefect.runtime import deployment, flow_run

from miles_core.config import Override, RunConfig, load_config
from miles_core.driver import ray_jobs
from miles_core.driver.session import TrainSpec
from miles_core.evaluation import reports
from miles_core.metrics import AFTER, BEFORE, HELDOUT, REWARD_MEAN
from miles_core.preflight import preflight
from miles_core.storage import checkpoint as ckpt
from miles_core.storage import object_store as storage
from miles_core.storage.artifacts import ModelArtifact
from miles_core.summary import STAGES, SUMMARY_FILE, HeldOutScores, MlflowRef, RunSummary, WarmupRecord
from miles_core.tracking import registry
from miles_core.tracking import runs as tracking
from tasks.artifacts import convert_checkpoint, prepare_data, prepare_model, prepare_teacher, sft_warmup
from tasks.cluster import ensure_ray
from tasks.evaluate import evaluate
from tasks.promote import PromotionRolledBack, promote
from tasks.publish import register_model, upload_artifacts
from tasks.train import train


class StageTimer:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        if name not in STAGES:
            raise ValueError(f"stage {name!r} is not in miles_core.summary.STAGES: add it there, in the flow's order")
        started = time.perf_counter()
        get_run_logger().info("stage %s ...", name)
        yield
        self.seconds[name] = round(time.perf_counter() - started, 2)
        get_run_logger().info("stage %s done in %.1f s", name, self.seconds[name])


def _promote(cfg: RunConfig, uri: str, version: str) -> dict:
    """The eval gate after registration. A rolled-back promotion leaves the old champion in
    place and is recorded, not raised: the trained, registered model must not be lost."""
    t = cfg.tracking
    if not t.promote:
        return {"promoted": False, "reason": "tracking.promote is false", "version": version}
    try:
        return promote(uri, t.registered_model_name, version, t.promote_min_score, t.promote_min_improvement)
    except PromotionRolledBack as exc:
        get_run_logger().error("%s", exc)
        return {"promoted": False, "reason": "rolled back", "error": str(exc), "version": version}


def _student_and_teacher(cfg: RunConfig, base: ModelArtifact, warmed: ModelArtifact
                         ) -> tuple[ModelArtifact, ModelArtifact | None]:
    """The model RL starts from, and the distillation teacher (None without distillation).
    teacher_source `warmup` distils the warm-up's result into the untouched starting model;
    any other teacher_source is prepared (downloaded, cached) like model.source."""
    if cfg.algorithm.effective_opd_coef == 0:
        return warmed, None
    if cfg.algorithm.teacher_source == "warmup":
        return base, warmed
    return warmed, prepare_teacher(cfg)


def _run_key(resume_from: str | None, flow_run_id) -> str:
    """The run's durable identity: the run it resumes, else this flow run."""
    return ckpt.check_run_key(resume_from or str(flow_run_id or f"local-{int(time.time())}"))


def _hook_context(flow_run) -> tuple[RunConfig, str]:
    """The recipe and run key of a flow run, rebuilt from its parameters (state hooks get no result)."""
    params = flow_run.parameters
    cfg = load_config(params.get("config_path", "configs/local.yaml"), params.get("overrides") or [])
    return cfg, _run_key(params.get("resume_from"), flow_run.id)


def _stop_driver_jobs(flow, flow_run, state) -> None:
    """on_cancellation: a driver Ray Job must not go on training after its flow run."""
    cfg, run_key = _hook_context(flow_run)
    if cfg.placement.driver == "ray_job":
        stopped = ray_jobs.stop_live(ray_jobs.jobs_client(cfg.placement), run_key)
        flow_run_logger(flow_run, flow).info("flow run cancelled: stopped driver jobs %s", stopped)


def _mark_mlflow_failed(flow, flow_run, state) -> None:
    """on_failure / on_crashed: the MLflow run ends FAILED instead of staying RUNNING (a later
    `miles run --resume` or `resume_from` sets it RUNNING again)."""
    cfg, run_key = _hook_context(flow_run)
    found = tracking.find_run(cfg, run_key)
    if found is not None:
        tracking.finish(*found, "FAILED")
        flow_run_logger(flow_run, flow).info("MLflow run %s marked FAILED", found[1])


def _open_run_dir(cfg: RunConfig, run_key: str, resume_from: str | None, run_dir: str | None) -> Path:
    """The run's local directory with its key and resolved config (secrets redacted, owner-only).
    A resume of a run MLflow does not know, or a directory holding another run's (or anything
    else's) files, fails first, with nothing written."""
    if resume_from:
        tracking.check_resumable_run(cfg, run_key)
    run_path = Path(run_dir).resolve() if run_dir else cfg.storage.work_path / "runs" / run_key
    ckpt.check_run_dir(run_path, run_key)
    run_path.mkdir(parents=True, exist_ok=True)
    (run_path / ckpt.RUN_KEY_FILE).write_text(run_key)  # first: any file in the directory is this run's
    storage.write_private_text(run_path / "config.resolved.json",
                               json.dumps(tracking.redact(cfg.model_dump(mode="json")), indent=1))
    return run_path


@flow(name="rl-posttrain", log_prints=True, on_cancellation=[_stop_driver_jobs],
      on_failure=[_mark_mlflow_failed], on_crashed=[_mark_mlflow_failed])
def rl_posttrain(config_path: str = "configs/local.yaml", overrides: list[Override] | None = None,
                 resume_from: str | None = None, run_dir: str | None = None) -> dict:
    """RL post-training of one recipe, durable stage by stage; returns the run summary."""
    cfg = load_config(config_path, overrides or [])
    preflight(cfg)  # inputs usable: before any directory, MLflow run or Ray start
    run_key = _run_key(resume_from, flow_run.id)
    run_path = _open_run_dir(cfg, run_key, resume_from, run_dir)
    uri, mlflow_run = tracking.start_or_attach_run(cfg, run_key, {
        "miles.flow_run_id": str(flow_run.id), "miles.deployment": str(deployment.name or "none"),
        "miles.git_commit": ckpt.git_commit() or "unknown"})
    timer = StageTimer()
    with timer("prepare_model"):
        model = prepare_model(cfg)
    with timer("prepare_data"):
        data = prepare_data(cfg)
    with timer("ensure_ray"):
        ensure_ray(cfg.placement.ray_address, cfg.placement.num_cpus, cfg.storage.work_dir)
    with timer("sft_warmup"):
        warmed = sft_warmup(cfg, model, data)
    with timer("prepare_teacher"):
        policy, teacher = _student_and_teacher(cfg, model, warmed)
    with timer("convert"):
        converted = convert_checkpoint(cfg, policy)
    with timer("eval_before"):
        before = evaluate(cfg, policy.model_dir, data.eval_path, BEFORE)
    tracking.log_eval_file(uri, mlflow_run, BEFORE, before[HELDOUT])
    reports.log_eval_metrics(uri, mlflow_run, BEFORE, before, step=0)
    spec = TrainSpec(config=cfg, model_dir=converted.model_dir, megatron_dir=converted.megatron_dir,
                     teacher_dir=teacher and teacher.model_dir, train_path=data.train_path, eval_path=data.eval_path,
                     run_dir=str(run_path), store_uri=cfg.storage.store_uri(), run_key=run_key,
                     mlflow_uri=uri, mlflow_run_id=mlflow_run)
    with timer("train"):
        result = train(spec)
    with timer("upload"):
        uploaded = upload_artifacts(cfg.storage.store_uri(), run_key, result.final_checkpoint_dir,
                                    result.hf_export_dir, cfg.checkpoint)
    with timer("eval_after"):
        after = evaluate(cfg, result.hf_export_dir, data.eval_path, AFTER)
    tracking.log_eval_file(uri, mlflow_run, AFTER, after[HELDOUT])
    after_metrics = reports.log_eval_metrics(uri, mlflow_run, AFTER, after, step=result.steps)
    # From MLflow, not result.history: after a resume the driver saw only its own steps.
    reward_curve = [round(value, 4) for _, value in tracking.metric_history(uri, mlflow_run, REWARD_MEAN)]
    periodic = reports.periodic_points_of_run(uri, mlflow_run)
    reports.log_report(uri, mlflow_run, before, after, reward_curve, periodic, final_step=result.steps)
    with timer("register"):
        version = register_model(uri, mlflow_run, cfg.tracking.registered_model_name, result.hf_export_dir,
                                 {"run_key": run_key, "checkpoint_uri": uploaded.checkpoint_uri,
                                  **registry.score_tag(after_metrics),
                                  **registry.weights_tags(cfg.training),
                                  "eval_report_uri": tracking.artifact_uri(uri, mlflow_run, reports.REPORT_ARTIFACT),
                                  "train_data": data.train_path, "eval_data": data.eval_path}, step=result.steps)
    with timer("promote"):
        promotion = _promote(cfg, uri, str(version))
    summary = RunSummary(
        run_key=run_key, status="completed", run_dir=str(run_path),
        eval=HeldOutScores(before=before[HELDOUT].pass_at_1, after=after[HELDOUT].pass_at_1,
                           num_prompts=after[HELDOUT].num_prompts),
        eval_details={BEFORE: reports.summary_metrics(before), AFTER: reports.summary_metrics(after)},
        warmup=WarmupRecord(sft_steps=warmed.sft_steps, probe_pass_at_1=warmed.probe_pass_at_1,
                            reached_target=warmed.reached_target),
        teacher_dir=teacher and teacher.model_dir, promotion=promotion,
        steps=result.steps, resumed_from_step=result.resumed_from_step,
        checkpoint_uri=uploaded.checkpoint_uri, hf_export_uri=uploaded.hf_export_uri,
        hf_export_dir=result.hf_export_dir, model_version=str(version), data=data,
        mlflow=MlflowRef(tracking_uri=uri, run_id=mlflow_run, model_name=cfg.tracking.registered_model_name),
        reward_curve=reward_curve, periodic_eval=periodic, timings=timer.seconds,
    ).redacted()
    (run_path / SUMMARY_FILE).write_text(summary.model_dump_json(indent=1))
    tracking.finish(uri, mlflow_run, "FINISHED")
    return summary.model_dump(mode="json")
