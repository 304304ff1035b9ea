"""The Kubernetes manifests rendered from the production recipe match the reviewed snapshots.

After an intended change: `miles k8s render configs/qwen3-4b-grpo-dapo.yaml --out-dir tests/unit/snapshots`.
"""

import json

import yaml
from typer.testing import CliRunner

from flows.cli import app
from tests.conftest import REPO

SNAPSHOTS = REPO / "tests/unit/snapshots"


def test_rendered_manifests_match_snapshots(tmp_path):
    result = CliRunner().invoke(app, ["k8s", "render", str(REPO / "configs/qwen3-4b-grpo-dapo.yaml"),
                                      "--out-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "rayjob.yaml").read_text() == (SNAPSHOTS / "rayjob.yaml").read_text()
    assert (tmp_path / "work-pool-template.json").read_text() == (SNAPSHOTS / "work-pool-template.json").read_text()


def test_rayjob_is_sized_from_the_recipe():
    job = yaml.safe_load((SNAPSHOTS / "rayjob.yaml").read_text())
    workers = job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]
    # 1 trainer GPU + 7 engines x 1 GPU = one 8-GPU node
    assert workers["replicas"] == 1
    assert workers["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "8"
    template = json.loads((SNAPSHOTS / "work-pool-template.json").read_text())
    assert "secretRef" in json.dumps(template) and "AWS_SECRET" not in json.dumps(template)


def test_ray_runs_with_token_auth_from_the_secret():
    job = yaml.safe_load((SNAPSHOTS / "rayjob.yaml").read_text())
    spec = job["spec"]["rayClusterSpec"]
    for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
        env = {e["name"]: e for e in group["template"]["spec"]["containers"][0]["env"]}
        assert env["RAY_AUTH_MODE"]["value"] == "token"
        assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]["key"] == "RAY_AUTH_TOKEN"
    template = json.loads((SNAPSHOTS / "work-pool-template.json").read_text())
    assert template["variables"]["properties"]["env"]["default"] == {"RAY_AUTH_MODE": "token"}
