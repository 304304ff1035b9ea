"""The `rl-eval` flow: evaluate one model (export, checkpoint or registry version) on a recipe's
eval datasets and log the results to a new MLflow run tagged miles.eval_of=<uri>.

    from flows.rl_eval import rl_eval
    rl_eval("models:/miles-tiny@champion", "configs/local.yaml")
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from prefect import flow, task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run

from miles_core.config import Override, RunConfig, load_config
from miles_core.evaluation import reports
from miles_core.metrics import AFTER
from miles_core.storage import artifacts
from miles_core.tracking import runs as tracking
from tasks.artifacts import prepare_data
from tasks.cluster import ensure_ray
from tasks.evaluate import evaluate


@task(name="fetch-model", cache_policy=NO_CACHE)
def fetch_model(model_uri: str, cfg: RunConfig, dest: str) -> str:
    """models:/ URIs through the registry, fsspec URIs downloaded, local paths used in place."""
    return str(artifacts.fetch_model(model_uri, cfg, Path(dest)))


@flow(name="rl-eval", log_prints=True)
def rl_eval(checkpoint_uri: str, config_path: str = "configs/local.yaml",
            overrides: list[Override] | None = None) -> dict:
    """Evaluate checkpoint_uri with the recipe's eval settings; returns {dataset: result}."""
    cfg = load_config(config_path, overrides or [])
    run_key = f"eval-{flow_run.id or int(time.time())}"
    work = cfg.storage.work_path / "evals" / run_key
    uri, run_id = tracking.start_or_attach_run(cfg, run_key, {"miles.eval_of": checkpoint_uri})
    try:
        model_dir = fetch_model(checkpoint_uri, cfg, str(work))
        ensure_ray(cfg.placement.ray_address, cfg.placement.num_cpus, cfg.storage.work_dir)
        results = evaluate(cfg, model_dir, prepare_data(cfg).eval_path, "eval")
        reports.log_eval_metrics(uri, run_id, AFTER, results, step=0)
        reports.log_report(uri, run_id, None, results, [])
        written = {name: result.to_json() for name, result in results.items()}  # the files' schema
        tracking.client_for(uri).log_dict(run_id, written, "eval/results.json")
    except BaseException:
        tracking.finish(uri, run_id, "FAILED")
        raise
    tracking.finish(uri, run_id, "FINISHED")
    summary = {"checkpoint_uri": checkpoint_uri, "model_dir": model_dir, "results": written,
               "mlflow": {"tracking_uri": uri, "run_id": run_id}}
    work.mkdir(parents=True, exist_ok=True)
    (work / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    return summary
