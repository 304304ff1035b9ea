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
