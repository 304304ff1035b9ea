"""Run configuration: one pydantic schema for every recipe, YAML + dotted overrides.

Every field carries a docstring (shown by `miles plan` and in validation errors). Unknown
fields are rejected so that a typo never silently falls back to a default.

    base.py       Section (the shared pydantic settings) and ConfigError
    schema.py     the sections and RunConfig
    algorithm.py  the `algorithm` section (objectives, clipping, KL, mismatch correction)
    precision.py  checks that rollout.precision and training.fp8 fit the rest of a recipe
    loading.py    YAML + `--set` overrides -> a validated RunConfig; the field reference
"""

from miles_core.config.algorithm import (
                                         ALGORITHMS,
                                         GROUP_ALGORITHMS,
                                         KL_IN_REWARD_ALGORITHMS,
                                         AlgorithmConfig,
                                         CorrectionConfig,
)
from miles_core.config.base import ConfigError, Section
from miles_core.config.loading import Override, build_config, field_docs, load_config, parse_overrides
from miles_core.config.schema import (
                                         ArithmeticTaskConfig,
                                         CheckpointConfig,
                                         DataConfig,
                                         EvalConfig,
                                         EvalDatasetConfig,
                                         ModelConfig,
                                         PlacementConfig,
                                         RolloutConfig,
                                         RunConfig,
                                         StorageConfig,
                                         TinyModelConfig,
                                         TrackingConfig,
                                         WarmupConfig,
)
from miles_core.config.training import MegatronConfig, TrainingConfig

__all__ = ["ALGORITHMS", "GROUP_ALGORITHMS", "KL_IN_REWARD_ALGORITHMS", "AlgorithmConfig", "ArithmeticTaskConfig",
           "CheckpointConfig", "ConfigError", "CorrectionConfig", "DataConfig", "EvalConfig", "EvalDatasetConfig",
           "MegatronConfig", "ModelConfig", "Override", "PlacementConfig", "RolloutConfig", "RunConfig", "Section",
           "StorageConfig", "TinyModelConfig", "TrackingConfig", "TrainingConfig", "WarmupConfig", "build_config",
           "field_docs", "load_config", "parse_overrides"]
