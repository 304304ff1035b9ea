"""The SFT warm-up: stops at its probe target, reports when it cannot reach it, and is
deterministic (same seed, same weights)."""

import logging

import pytest
from transformers import AutoTokenizer

from miles_core.data import read_prompts
from miles_core.engines.embedded.engine import EmbeddedEngine
from miles_core.evaluation.core import evaluate_greedy
from miles_core.warmup import run_sft_warmup, split_probe
from miles_core.weight_sync.layout import weights_sha256


def prompts_of(warm_tiny):
    tokenizer = AutoTokenizer.from_pretrained(warm_tiny["base"])
    return read_prompts(warm_tiny["train"], warm_tiny["cfg"].data, tokenizer), tokenizer


def overridden(cfg, **warmup):
    return cfg.model_copy(update={"warmup": cfg.warmup.model_copy(update=warmup)})


def probe_score(cfg, model_dir, probe) -> float:
    engine = EmbeddedEngine(str(model_dir), num_threads=cfg.training.num_threads)
    return evaluate_greedy(engine, probe, cfg.rollout.reward, cfg.eval.max_new_tokens, 256).pass_at_1


def test_recipe_warmup_reaches_its_target_on_held_out_probe_prompts(warm_tiny):
    cfg, result = warm_tiny["cfg"], warm_tiny["result"]
    assert cfg.warmup.target_pass_at_1 is not None  # the default recipe stops on quality, not a step count
    assert result.reached_target and result.sft_steps < cfg.warmup.sft_steps
    assert result.sft_steps % cfg.warmup.check_interval_steps == 0
    prompts, _ = prompts_of(warm_tiny)
    train, probe = split_probe(cfg, prompts)
    assert len(probe) == cfg.warmup.num_probe_prompts and not {p.index for p in probe} & {p.index for p in train}
    # the reported score is the saved model's
    assert probe_score(cfg, result.model_dir, probe) == pytest.approx(result.probe_pass_at_1)
    assert result.probe_pass_at_1 >= cfg.warmup.target_pass_at_1


def test_warmup_stops_at_the_first_check_that_meets_the_target(ray_local, warm_tiny, tmp_path):
    # From the warmed model with a tiny step size, so the probe stays near its ~0.3 (a fresh
    # Adam at the recipe's rate first knocks a trained model down for a few steps).
    cfg = overridden(warm_tiny["cfg"], target_pass_at_1=0.05, check_interval_steps=2, sft_steps=50, lr=1e-6)
    prompts, tokenizer = prompts_of(warm_tiny)
    seen = []
    result = run_sft_warmup(cfg, str(warm_tiny["warm"]), prompts, tokenizer, tmp_path / "out",
                            on_step=lambda step, loss, probe: seen.append((step + 1, probe)))
    assert result.steps == 2 and result.reached_target
    assert seen == [(1, None), (2, result.probe_pass_at_1)]


def test_an_sglang_recipe_probes_on_an_embedded_engine(ray_local, warm_tiny, tmp_path):
    """The probe runs in the warm-up's own process whatever rollout.engine is (an SGLang recipe's
    warm-up once failed reading embedded-only memory bounds from the SGLang engine's config)."""
    from miles_core.config.rollout import SGLangEngineConfig

    cfg = overridden(warm_tiny["cfg"], target_pass_at_1=0.05, check_interval_steps=2, sft_steps=50, lr=1e-6)
    cfg = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"engine": SGLangEngineConfig()})})
    prompts, tokenizer = prompts_of(warm_tiny)
    result = run_sft_warmup(cfg, str(warm_tiny["warm"]), prompts, tokenizer, tmp_path / "out")
    assert result.steps == 2 and result.reached_target


def test_an_unreached_target_trains_every_step_and_warns(ray_local, warm_tiny, tmp_path, caplog):
    cfg = overridden(warm_tiny["cfg"], target_pass_at_1=1.0, check_interval_steps=2, sft_steps=3)
    prompts, tokenizer = prompts_of(warm_tiny)
    with caplog.at_level(logging.WARNING, logger="miles_core.warmup"):
        result = run_sft_warmup(cfg, str(warm_tiny["base"]), prompts, tokenizer, tmp_path / "out")
    assert result.steps == 3 and result.reached_target is False and result.probe_pass_at_1 < 1.0
    assert "below warmup.target_pass_at_1" in caplog.text


def test_same_seed_gives_the_same_warmup_weights(ray_local, warm_tiny, tmp_path):
    cfg = overridden(warm_tiny["cfg"], target_pass_at_1=None, sft_steps=4)
    prompts, tokenizer = prompts_of(warm_tiny)
    digests = []
    for run in ("a", "b", "other-seed"):
        run_cfg = cfg.model_copy(update={"seed": 7}) if run == "other-seed" else cfg
        out = run_sft_warmup(run_cfg, str(warm_tiny["base"]), prompts, tokenizer, tmp_path / run)
        digests.append(weights_sha256(EmbeddedEngine(str(out.model_dir)).model.state_dict()))
    assert digests[0] == digests[1] and digests[0] != digests[2]


def test_probe_needs_training_prompts_left(warm_tiny):
    prompts, _ = prompts_of(warm_tiny)
    cfg = overridden(warm_tiny["cfg"], num_probe_prompts=len(prompts))
    with pytest.raises(ValueError, match="num_probe_prompts"):
        split_probe(cfg, prompts)
