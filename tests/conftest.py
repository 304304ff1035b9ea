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
def warm_tiny(tmp_path_factory) -> dict:
    """The tiny model after the default recipe's SFT warm-up (configs/local.yaml, real Ray
    trainer actor), with the built-in task's data: for every test that needs a model that
    already scores. Built once per session; {"cfg", "base", "warm", "train", "eval"}."""
    import ray
    import yaml
    from transformers import AutoTokenizer

    from miles_core.config import build_config
    from miles_core.data import read_prompts, write_arithmetic_task
    from miles_core.tiny import build_tiny_model
    from miles_core.warmup import run_sft_warmup

    root = tmp_path_factory.mktemp("warm")
    cfg = build_config(yaml.safe_load((REPO / "configs/local.yaml").read_text()))
    base = build_tiny_model(cfg.model.tiny, root / "base")
    train, held_out = write_arithmetic_task(cfg.data.builtin, root / "data")
    tokenizer = AutoTokenizer.from_pretrained(base)
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, configure_logging=False)
    try:
        warm = run_sft_warmup(cfg, str(base), read_prompts(train, cfg.data, tokenizer), tokenizer, root / "warm")
    finally:
        if started:
            ray.shutdown()
    return {"cfg": cfg, "base": base, "warm": warm.model_dir, "train": train, "eval": held_out, "result": warm}
