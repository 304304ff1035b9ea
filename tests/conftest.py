import os
from pathlib import Path

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]


def run_env(prefect_api: dict[str, str] | None = None, **extra: str) -> dict[str, str]:
    """The environment of a `miles ...` subprocess: this process's, without the Prefect and
    MLflow settings other tests may have set, with the repo importable. Given `prefect_api`
    (the fixture), runs use that server, as under a user's stack; without it each run starts
    Prefect's temporary server under its work dir, as a bare `miles run` does."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
    return {**env, "PYTHONPATH": str(REPO), **(prefect_api or {}), **extra}


@pytest.fixture(scope="session")
def prefect_api(tmp_path_factory):
    """The Prefect server of `miles stack up`, started once for the session: each run given its
    PREFECT_API_URL (run_env) skips starting a temporary server of its own, 5-12 s."""
    from infra import stack

    state_dir = tmp_path_factory.mktemp("prefect-stack")
    info = stack.start_stack(state_dir, services=["prefect"], timeout=240)
    try:
        yield {"PREFECT_API_URL": info.env["PREFECT_API_URL"]}
    finally:
        stack.stop_stack(state_dir)


@pytest.fixture(scope="session", autouse=True)
def _early_network_checks(request, tmp_path_factory):
    """Starts, as the session begins, work that mostly waits on the network, so that it overlaps
    with the tests before the one that needs it: the cluster profiles' pip dry runs (50-100 s
    on the package index; tests/unit/test_cluster_install.py runs near the end of the session)."""
    if any(item.path.name == "test_cluster_install.py" and "resolutions" in getattr(item, "fixturenames", ())
           for item in request.session.items):
        from tests.unit import test_cluster_install

        test_cluster_install.start_resolving(tmp_path_factory.mktemp("cluster-profiles"))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A built-in tiny model (random weights) shared by the unit tests."""
    from miles_core.config import TinyModelConfig
    from miles_core.tiny import build_tiny_model

    return build_tiny_model(TinyModelConfig(), tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def tiny_moe_model_dir(tmp_path_factory) -> Path:
    """The tiny model's shape as a Qwen3-MoE with 4 experts, top-2 (random weights)."""
    from miles_core.config import TinyModelConfig
    from miles_core.tiny import build_tiny_moe_model

    return build_tiny_moe_model(TinyModelConfig(), tmp_path_factory.mktemp("tiny-moe") / "model")


@pytest.fixture(scope="session")
def shared_work_dir(tmp_path_factory) -> Path:
    """One storage.work_dir for the session: the default recipe's cached stages (built-in model,
    data, SFT warm-up) are built once, by `warm_tiny` or the first e2e run, and reused by all,
    as runs on one machine reuse them."""
    return tmp_path_factory.mktemp("shared-work")


@pytest.fixture(scope="session")
def warm_tiny(shared_work_dir) -> dict:
    """The tiny model after the default recipe's SFT warm-up (configs/local.yaml, real Ray
    trainer actor), with the built-in task's data: for every test that needs a model that
    already scores. Built once per session, where the e2e runs find it;
    {"cfg", "base", "warm", "train", "eval", "result"}."""
    import ray
    import yaml

    from miles_core.config import build_config
    from miles_core.storage import artifacts

    cfg = build_config(yaml.safe_load((REPO / "configs/local.yaml").read_text()),
                       [f"storage.work_dir={shared_work_dir}"])
    model, data = artifacts.prepare_model(cfg), artifacts.prepare_data(cfg)
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, configure_logging=False)
    try:
        warm = artifacts.warm_up(cfg, model, data)
    finally:
        if started:
            ray.shutdown()
    return {"cfg": cfg, "base": Path(model.model_dir), "warm": Path(warm.model_dir), "train": Path(data.train_path),
            "eval": Path(data.eval_path), "result": warm}


def _module_ray(num_cpus: int):
    import ray

    if ray.is_initialized():  # left up by a test that failed mid-way: it must not fail every later module
        ray.shutdown()
    ray.init(num_cpus=num_cpus, include_dashboard=False, configure_logging=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def ray_local():
    """A local Ray of 2 CPUs for one test module."""
    yield from _module_ray(2)


@pytest.fixture(scope="module")
def ray_local_3cpus():
    """A local Ray of 3 (logical) CPUs: two trainer ranks or engines of 1 CPU each, plus one more."""
    yield from _module_ray(3)
