"""MoE routing replay against a REAL SGLang (0.5.17) on a lent GPU (not run in CI): SGLang,
started with enable_return_routed_experts, returns each token's experts for a tiny Qwen3-MoE;
they are the experts HF's own router picks for the same tokens, and the Megatron trainer's
routers, replaying them, use exactly those experts (its log-probs then follow SGLang's even with
routers perturbed to choose otherwise). Set up as tests/gpu/test_sglang_real.py says, with
tests/gpu/carry.py's megatron set too:

    SGLANG_PYTHON=/tmp/sgl-python python3 -m pytest tests/gpu/test_routing_replay_sglang.py -s
"""

from __future__ import annotations

import secrets
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.gpu.test_sglang_real import SGLANG_PYTHON, say  # stubs Ray where it is absent

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"),
              pytest.mark.skipif(not SGLANG_PYTHON, reason="set SGLANG_PYTHON to an interpreter that has SGLang")]

# No deterministic inference or memory saver: neither is what this checks. head_dim 64 (hidden
# 256 over 4 heads) suits SGLang's triton attention kernels.
SERVER_ARGS = {"attention_backend": "triton", "sampling_backend": "pytorch", "grammar_backend": "none",
               "mem_fraction_static": 0.2, "skip_server_warmup": True, "enable_return_routed_experts": True}
# bf16 serving against an fp32 router: near-tied experts may swap; the rest must agree.
MIN_TOPK_AGREEMENT = 0.95


class _Engines:
    """What RolloutManager needs of an engine group: the router over the one server."""

    num_healthy = 1

    def __init__(self, router):
        self.router = router

    def generate(self, input_ids, sampling_params, **extra):
        return self.router.generate(input_ids, sampling_params, **extra)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from miles_core.config.rollout import SGLangEngineConfig
    from miles_core.engines.sglang.client import SGLangClient
    from miles_core.rollout.engine_group import launch_engine
    from miles_core.rollout.router import Router
    from tests.integration import test_routing_replay as r3

    dirs = r3.build_moe_dirs(tmp_path_factory.mktemp("r3-sglang"), hidden_size=256, moe_intermediate_size=128)
    api_key = secrets.token_urlsafe(16)
    started = time.perf_counter()
    launcher = launch_engine(SGLangEngineConfig(server_args=SERVER_ARGS, python=SGLANG_PYTHON), str(dirs["moe"]),
                             "127.0.0.1", "bfloat16", 4, 1.0, api_key)
    say(f"MoE server healthy in {time.perf_counter() - started:.1f} s")
    router = Router([SGLangClient(launcher.url, api_key=api_key, timeout_seconds=120)])
    try:
        yield {"dirs": dirs, "engines": _Engines(router)}
    finally:
        router.close()
        launcher.stop()


def _samples(served, n: int = 4):
    from miles_core.config import RolloutConfig
    from miles_core.rollout.manager import RolloutManager
    from tests.integration import test_routing_replay as r3

    rollout = RolloutConfig(num_samples_per_prompt=1, max_new_tokens=8, temperature=1.0)
    manager = RolloutManager(served["engines"], rollout, "exact_match", return_routed_experts=True)
    return manager.generate(r3._prompts(n), seed=0)


def test_sglang_experts_are_the_hf_routers_choice(served):
    from transformers import Qwen3MoeForCausalLM

    from tests.integration import test_routing_replay as r3

    samples = _samples(served)
    model = Qwen3MoeForCausalLM.from_pretrained(served["dirs"]["moe"], dtype=torch.float32).eval()
    agree = total = 0
    for s in samples:
        ids = s.prompt_ids + s.response_ids
        routed = np.sort(np.asarray(s.routed_experts).reshape(len(ids) - 1, r3.NUM_LAYERS, r3.TOP_K), -1)
        expected = np.sort(r3._hf_topk(model, ids)[:-1], -1)
        agree += int((routed == expected).all(-1).sum())
        total += routed.shape[0] * r3.NUM_LAYERS
    say(f"SGLang's experts = HF's top-{r3.TOP_K} for {agree} of {total} token-layers")
    assert agree / total >= MIN_TOPK_AGREEMENT


def test_megatron_replays_sglang_experts(served):
    from tests.integration import test_routing_replay as r3

    samples = _samples(served)
    expected, real = r3._expected_maps(samples)
    trainer = r3._trainer(served["dirs"]["moe"])
    try:
        out = r3.replay_then_free(trainer, samples)
    finally:
        trainer.close()
    replayed, free = out["replayed"], out["free"]
    say(f"max |Megatron - SGLang| log-prob, perturbed routers: with replay {replayed:.3e}, without {free:.3e}")
    r3.check_replay(out, expected, real)
