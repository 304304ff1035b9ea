"""The SFT warm-up trains on the run's backend, built through the run's trainer factory: a
Megatron recipe warms up on the Megatron trainer, and its cached warm-up is not an FSDP2 one."""

import pytest
from transformers import AutoTokenizer

from miles_core.config import load_config
from miles_core.data import read_prompts, write_arithmetic_task
from miles_core.driver import run as driver_run
from miles_core.storage.artifacts import ModelArtifact, warmup_identity
from miles_core.warmup import run_sft_warmup
from miles_core.weight_sync.layout import weights_sha256
from tests.conftest import REPO

MEGATRON_RECIPE = REPO / "configs/local-megatron.yaml"


def megatron_recipe(tmp_path, **warmup):
    cfg = load_config(MEGATRON_RECIPE, [f"storage.work_dir={tmp_path / 'work'}"])
    return cfg.model_copy(update={"warmup": cfg.warmup.model_copy(update=warmup)})


def test_a_megatron_recipe_warms_up_on_the_megatron_trainer(ray_local, tiny_model_dir, tmp_path, monkeypatch):
    pytest.importorskip("megatron.core")
    from miles_core.engines.embedded.engine import EmbeddedEngine

    cfg = megatron_recipe(tmp_path, sft_steps=2, batch_size=8, target_pass_at_1=None)
    built = []
    megatron = driver_run.TRAINER_BACKENDS["megatron"]
    monkeypatch.setitem(driver_run.TRAINER_BACKENDS, "megatron", lambda: built.append("megatron") or megatron())
    monkeypatch.setitem(driver_run.TRAINER_BACKENDS, "fsdp2", lambda: pytest.fail("the warm-up built FSDP2"))
    train_path, _ = write_arithmetic_task(cfg.data.builtin, tmp_path / "data")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = read_prompts(train_path, cfg.data, tokenizer)
    result = run_sft_warmup(cfg, str(tiny_model_dir), prompts, tokenizer, tmp_path / "out")
    assert built == ["megatron"] and result.steps == 2
    # the export is an HF directory the engines load, holding the trained (changed) weights
    trained = weights_sha256(EmbeddedEngine(str(result.model_dir)).model.state_dict())
    assert trained != weights_sha256(EmbeddedEngine(str(tiny_model_dir)).model.state_dict())


def test_the_warmup_cache_key_tells_backends_apart_and_keeps_fsdp2_keys(tmp_path):
    from miles_core.storage.artifacts import ARTIFACT_VERSION, digest

    megatron = megatron_recipe(tmp_path)
    fsdp = megatron.model_copy(update={"training": megatron.training.model_copy(update={"backend": "fsdp2"})})
    model = ModelArtifact(model_dir=str(tmp_path), identity="model-x")
    assert warmup_identity(megatron, model) != warmup_identity(fsdp, model)
    # the key FSDP2 warm-ups were cached under before the backend counted
    before = "warmup-" + digest(ARTIFACT_VERSION, model.identity, fsdp.warmup.model_dump(),
                                fsdp.data.model_dump(mode="json"), fsdp.seed, fsdp.training.micro_batch_size)
    assert warmup_identity(fsdp, model) == before
