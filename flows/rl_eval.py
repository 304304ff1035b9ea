"""The `rl-eval` flow: evaluate one model (export, checkpoint or registry version) on a recipe's
eval datasets and log the results to a new MLflow run tagged miles.eval_of=<uri>.

    from flows.rl_eval import rl_eval
    rl_eval("models:/miles-tiny@champion", "configs/local.yaml")
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run

from miles_core import registry, reports, storage, tracking
from miles_core.config import RunConfig, load_config
from miles_core.evaluation import evaluate_all
from tasks.artifacts import prepare_data


def _as_hf_dir(local: Path, cfg: RunConfig, dest: Path) -> Path:
    """An HF directory as is; a training checkpoint (model.safetensors, no config.json) gets the
    config and tokenizer of the recipe's starting model, which has the same architecture."""
    if (local / "config.json").is_file():
        return local
    if not (local / "model.safetensors").is_file():
        raise FileNotFoundError(f"{local} has neither config.json (HF export) nor model.safetensors (checkpoint)")
    from miles_core.models import materialize_model

    base, _ = materialize_model(cfg.model, cfg.storage.cache_dir("models"))
    dest.mkdir(parents=True, exist_ok=True)
    for path in base.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and not path.name.endswith(".index.json"):
            shutil.copy2(path, dest / path.name)
    shutil.copy2(local / "model.safetensors", dest / "model.safetensors")
    return dest


@task(name="fetch-model", cache_policy=NO_CACHE)
def fetch_model(checkpoint_uri: str, config: dict, dest: str) -> str:
    """models:/ URIs through the registry, fsspec URIs downloaded, local paths used in place."""
    cfg, dest_path = RunConfig.model_validate(config), Path(dest)
    if checkpoint_uri.startswith("models:/"):
        local = registry.download_model(tracking.tracking_uri(cfg), checkpoint_uri, dest_path / "download")
    elif "://" in checkpoint_uri:
        local = storage.download_dir(checkpoint_uri, dest_path / "download")
    else:
        local = Path(checkpoint_uri).expanduser().resolve()
    return str(_as_hf_dir(local, cfg, dest_path / "hf"))


@task(name="evaluate-all", cache_policy=NO_CACHE)
def evaluate_model(config: dict, model_dir: str, eval_path: str) -> dict:
    results = evaluate_all(RunConfig.model_validate(config), model_dir, eval_path)
    for name, result in results.items():
        get_run_logger().info("eval %s: pass@1 %.3f", name, result["pass@1"])
    return results


@flow(name="rl-eval", log_prints=True)
def rl_eval(checkpoint_uri: str, config_path: str = "configs/local.yaml",
            overrides: list[str] | None = None) -> dict:
    """Evaluate checkpoint_uri with the recipe's eval settings; returns {dataset: result}."""
    cfg = load_config(config_path, overrides or [])
    config = cfg.model_dump(mode="json")
    run_key = f"eval-{flow_run.id or int(time.time())}"
    work = cfg.storage.work_path / "evals" / run_key
    uri, run_id = tracking.start_or_attach_run(cfg, run_key, {"miles.eval_of": checkpoint_uri})
    try:
        model_dir = fetch_model(checkpoint_uri, config, str(work))
        results = evaluate_model(config, model_dir, prepare_data(config=config)["eval_path"])
        reports.log_eval_metrics(uri, run_id, "after", results, step=0)
        reports.log_report(uri, run_id, None, results, [])
        tracking.client_for(uri).log_dict(run_id, results, "eval/results.json")
    except BaseException:
        tracking.finish(uri, run_id, "FAILED")
        raise
    tracking.finish(uri, run_id, "FINISHED")
    summary = {"checkpoint_uri": checkpoint_uri, "model_dir": model_dir, "results": results,
               "mlflow": {"tracking_uri": uri, "run_id": run_id}}
    work.mkdir(parents=True, exist_ok=True)
    (work / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    return summary
