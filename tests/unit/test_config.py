import pytest

from miles_core.config import ConfigError, RunConfig, build_config, field_docs, load_config
from tests.conftest import REPO


def test_local_recipe_validates_and_overrides_apply():
    cfg = load_config(REPO / "configs/local.yaml", ["training.lr=5e-4", "rollout.num_engines=2"])
    assert cfg.training.lr == 5e-4 and cfg.rollout.num_engines == 2
    assert cfg.model.source == "builtin:tiny-qwen3"


def test_unknown_field_is_named_with_a_fix():
    with pytest.raises(ConfigError) as err:
        build_config({"training": {"lr": 1e-3, "learning_rate": 1}})
    assert "training.learning_rate: unknown field" in str(err.value)


def test_bad_value_names_field_and_value():
    with pytest.raises(ConfigError) as err:
        build_config({}, ["rollout.num_samples_per_prompt=1"])
    message = str(err.value)
    assert "num_samples_per_prompt >= 2" in message


def test_wrong_type_reports_input():
    with pytest.raises(ConfigError) as err:
        build_config({}, ["training.num_steps=many"])
    assert "training.num_steps" in str(err.value) and "'many'" in str(err.value)


def test_malformed_override_explains_syntax():
    with pytest.raises(ConfigError, match="expected dotted.key=value"):
        build_config({}, ["training.lr"])


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("training: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_every_field_is_documented():
    undocumented = [name for name, _, doc in field_docs() if not doc]
    assert undocumented == []


def test_digest_changes_with_content():
    assert RunConfig().digest() == RunConfig().digest()
    assert RunConfig().digest() != build_config({}, ["seed=7"]).digest()


def test_hf_source_shape_and_sglang_needs_gpu():
    with pytest.raises(ConfigError, match="hf://org/repo"):
        build_config({"model": {"source": "hf://justrepo"}})
    with pytest.raises(ConfigError, match="gpus_per_engine"):
        build_config({"rollout": {"engine": "sglang", "weight_transport": "broadcast"}})
    with pytest.raises(ConfigError, match="weight_transport=broadcast"):
        build_config({"rollout": {"engine": "sglang", "gpus_per_engine": 1}})
