"""Kubernetes manifests for the same deployment: a Prefect work-pool base job template (the
flow-run pod) and a KubeRay RayJob (a Ray cluster that runs one training driver session,
`miles_core.driver.session`, from a TrainSpec file on a shared volume mounted at /run).

    miles k8s render configs/qwen3-4b-grpo-dapo.yaml --image ghcr.io/example/miles:0.1.0 --out-dir infra/k8s

The image (DEFAULT_IMAGE unless --image says otherwise) is the one infra/Dockerfile builds.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import typer
import yaml

from miles_core.config import RunConfig, load_config

GPUS_PER_NODE = 8
# What infra/Dockerfile is built and tagged as (tests/unit/test_cluster_install.py checks they agree).
DEFAULT_IMAGE = "ghcr.io/example/miles:0.1.0"
k8s_app = typer.Typer(help="Render Kubernetes manifests (Prefect work pool, KubeRay RayJob).", no_args_is_help=True)


def work_pool_template(image: str, namespace: str) -> dict:
    """Base job template of a `kubernetes` work pool: the flow-run pod (CPU only; the GPUs
    belong to the RayJob it submits). Secrets come from a Kubernetes Secret, never inline."""
    env_from = [{"secretRef": {"name": "{{ secret_name }}"}}]
    container = {"name": "prefect-job", "image": "{{ image }}", "args": "{{ command }}", "env": "{{ env }}",
                 "envFrom": env_from, "resources": {"requests": {"cpu": "2", "memory": "8Gi"}}}
    job = {"apiVersion": "batch/v1", "kind": "Job",
           "metadata": {"generateName": "{{ name }}-", "namespace": "{{ namespace }}", "labels": "{{ labels }}"},
           "spec": {"backoffLimit": 0, "ttlSecondsAfterFinished": "{{ finished_job_ttl }}",
                    "template": {"spec": {"restartPolicy": "Never", "serviceAccountName": "{{ service_account_name }}",
                                          "containers": [container]}}}}
    variables = {"type": "object", "properties": {
        "image": {"type": "string", "default": image, "description": "Image with this project installed."},
        "namespace": {"type": "string", "default": namespace},
        "secret_name": {"type": "string", "default": "miles-credentials",
                        "description": "Secret holding AWS_*, HF_TOKEN, MLFLOW_TRACKING_URI, RAY_AUTH_TOKEN."},
        "service_account_name": {"type": "string", "default": "miles-runner",
                                 "description": "Needs RBAC to create RayJobs in the namespace."},
        "finished_job_ttl": {"type": "integer", "default": 86400},
        "name": {"type": "string", "default": "rl-posttrain"}, "command": {"type": "string"},
        # the flow pod submits to a Ray cluster that runs with token auth (its token: the secret's)
        "env": {"type": "object", "default": {"RAY_AUTH_MODE": "token"}}, "labels": {"type": "object", "default": {}}}}
    return {"job_configuration": {"command": "{{ command }}", "env": "{{ env }}", "labels": "{{ labels }}",
                                  "name": "{{ name }}", "namespace": "{{ namespace }}", "job_manifest": job,
                                  "cluster_config": "{{ cluster_config }}", "job_watch_timeout_seconds": None,
                                  "pod_watch_timeout_seconds": 300, "stream_output": True},
            "variables": variables}


def _container(name: str, image: str, gpus: int, cpus: int, memory_gib: int) -> dict:
    limits = {"cpu": str(cpus), "memory": f"{memory_gib}Gi", **({"nvidia.com/gpu": str(gpus)} if gpus else {})}
    return {"name": name, "image": image, "resources": {"limits": limits, "requests": dict(limits)},
            # Ray's ports are open to the pod network: token auth, the token from the credentials secret
            "env": [{"name": "RAY_AUTH_MODE", "value": "token"},
                    {"name": "RAY_AUTH_TOKEN", "valueFrom": {"secretKeyRef": {"name": "miles-credentials",
                                                                               "key": "RAY_AUTH_TOKEN"}}},
                    {"name": "NCCL_NVLS_ENABLE", "value": "0"}],
            "envFrom": [{"secretRef": {"name": "miles-credentials"}}]}


def rayjob(cfg: RunConfig, image: str, namespace: str, run_key: str) -> dict:
    """A RayJob sized from the recipe's placement: trainer + engine GPUs packed on 8-GPU nodes."""
    gpus = math.ceil(cfg.training.gpus_per_trainer + cfg.rollout.num_engines * cfg.rollout.gpus_per_engine)
    nodes = max(1, math.ceil(gpus / GPUS_PER_NODE))
    worker = _container("ray-worker", image, min(gpus, GPUS_PER_NODE), 96, 900)
    return {
        "apiVersion": "ray.io/v1", "kind": "RayJob",
        "metadata": {"name": f"miles-{run_key}", "namespace": namespace,
                     "labels": {"app": "miles", "run-key": run_key}},
        "spec": {
            "entrypoint": ("python -m miles_core.driver.session --spec /run/spec.json --progress /run/progress.jsonl "
                           "--result /run/result.json"),
            "submissionMode": "K8sJobMode", "shutdownAfterJobFinishes": True, "ttlSecondsAfterFinished": 3600,
            "backoffLimit": 0,  # Prefect's task retries own re-submission (with resume)
            "rayClusterSpec": {
                "rayVersion": "2.60.0",
                "headGroupSpec": {"rayStartParams": {"num-cpus": "0"},
                                  "template": {"spec": {"containers": [_container("ray-head", image, 0, 8, 32)]}}},
                "workerGroupSpecs": [{"groupName": "gpu", "replicas": nodes, "minReplicas": nodes, "maxReplicas": nodes,
                                      "rayStartParams": {}, "template": {"spec": {"containers": [worker]}}}],
            },
        },
    }


@k8s_app.command("render")
def render(config: Path = typer.Argument(..., help="recipe YAML"),
           image: str = typer.Option(DEFAULT_IMAGE, help="container image (infra/Dockerfile)"),
           namespace: str = typer.Option("ml", help="Kubernetes namespace"),
           run_key: str = typer.Option("example", help="run key baked into the RayJob name"),
           out_dir: Path = typer.Option(Path("infra/k8s"), help="where to write the manifests")) -> None:
    """Write work-pool-template.json and rayjob.yaml for a recipe."""
    cfg = load_config(config)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "work-pool-template.json").write_text(json.dumps(work_pool_template(image, namespace), indent=2) + "\n")
    (out_dir / "rayjob.yaml").write_text(yaml.safe_dump(rayjob(cfg, image, namespace, run_key), sort_keys=False))
    typer.echo(f"wrote {out_dir}/work-pool-template.json and {out_dir}/rayjob.yaml")
