"""The train task: runs the training driver; a retry resumes from the latest checkpoint."""

from __future__ import annotations

from dataclasses import asdict

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from miles_core import tracking
from miles_core.train import TrainSpec, run_training
from tasks.retry import retry_infrastructure_only

@task(name="train", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=[10, 60],
      retry_jitter_factor=0.5, retry_condition_fn=retry_infrastructure_only)
def train(spec: dict, mlflow_uri: str, mlflow_run_id: str) -> dict:
    """RL training from spec; metrics go to the MLflow run as each step becomes durable."""
    logger = get_run_logger()
    metrics = tracking.MetricsLogger(mlflow_uri, mlflow_run_id)
    num_steps = spec["config"]["training"]["num_steps"]
    progress = Progress(TextColumn("[bold]RL"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        TextColumn("{task.fields[info]}"))
    with progress:
        bar = progress.add_task("rl", total=num_steps, info="")

        def on_step(state) -> None:
            last = state.history[-1]
            score = f"reward {last['rollout/reward_mean']:.3f}" if "rollout/reward_mean" in last else f"loss {last['train/loss']:.3f}"
            info = f"{score}  step {last['time/step_seconds']:.2f}s"
            progress.update(bar, completed=state.step, info=info)

        def on_checkpoint(step: int) -> None:
            metrics.flush()
            logger.info("checkpoint at step %d", step)

        result = run_training(TrainSpec(**spec), on_metrics=metrics.log, on_checkpoint=on_checkpoint,
                              on_step=on_step)
    metrics.flush()
    if result.resumed_from_step is not None:
        logger.info("resumed from step %d", result.resumed_from_step)
    return asdict(result)
