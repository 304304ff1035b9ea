"""Responses shaped the way SGLang's code builds them (the meta_info keys, finish reasons and
routed-expert encoding recorded in sglang_contract.json) replayed through the rollout manager
and the loop's version check."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pytest

from miles_core.config import RolloutConfig
from miles_core.rollout.manager import RolloutManager
from miles_core.types import Prompt

SNAPSHOT = json.loads((Path(__file__).parent / "sglang_contract.json").read_text())
NUM_LAYERS, TOP_K = 2, 2


def sglang_response(version: str, prompt: list[int], output: list[int], finish: dict, weight_version: str) -> dict:
    """One /generate answer: the primary meta_info literal of tokenizer_manager, the logprob
    triples, and routed experts as SGLang's detokenizer sends them (base64 of an int32 buffer
    [prompt + output - 1 positions, layers, top_k])."""
    primary = SNAPSHOT["versions"][version]["meta_info"]["primary_literal"]["keys"]
    values = {"id": "rid-1", "finish_reason": finish, "prompt_tokens": len(prompt), "weight_version": weight_version,
              "num_retractions": 0}
    positions = len(prompt) + len(output) - 1
    experts = np.arange(positions * NUM_LAYERS * TOP_K, dtype=np.int32) % 8
    meta = {key: values[key] for key in primary} | {
        "completion_tokens": len(output), "cached_tokens": 0, "e2e_latency": 0.01,
        "output_token_logprobs": [[-0.5, t, None] for t in output],
        "routed_experts": base64.b64encode(experts.tobytes()).decode()}
    return {"text": "".join(map(str, output)), "output_ids": output, "meta_info": meta}


class ReplayEngines:
    """An engine group whose engine answers with recorded SGLang shapes."""

    num_healthy = 1

    def __init__(self, version: str, weight_version: str):
        self.version, self.weight_version = version, weight_version
        self.requests: list[tuple[list[list[int]], list[dict], dict]] = []

    def generate(self, input_ids, sampling_params, **extra):
        self.requests.append((input_ids, sampling_params, extra))
        finishes = [{"type": "stop", "matched": 2}, {"type": "length", "length": 3},
                    {"type": "abort", "message": "Abort before prefill"}]
        return [sglang_response(self.version, ids, [7, 8, 2][: 1 + i % 3], finishes[i % 3], self.weight_version)
                for i, ids in enumerate(input_ids)]


@pytest.mark.parametrize("version", sorted(SNAPSHOT["versions"]))
def test_sglang_responses_become_samples(version):
    engines = ReplayEngines(version, weight_version="0")
    manager = RolloutManager(engines, RolloutConfig(num_samples_per_prompt=3), "exact_match", return_routed_experts=True)
    prompts = [Prompt(index=i, messages=[], label="78", input_ids=[1, 2, 3 + i]) for i in range(2)]
    samples = manager.generate(prompts, seed=4)
    assert [s.finish_reason for s in samples] == ["stop", "length", "abort"] * 2
    assert [s.response_ids for s in samples[:3]] == [[7], [7, 8], [7, 8, 2]]
    assert all(s.weight_version == "0" for s in samples)
    assert samples[1].rollout_logprobs == [-0.5, -0.5]
    routed = samples[2].routed_experts  # 3 prompt + 3 output tokens -> 5 positions of layers x top_k
    assert routed.shape == (5, NUM_LAYERS * TOP_K) and routed.dtype == np.int32
    [(_, params, extra)] = engines.requests
    assert len({p["sampling_seed"] for p in params}) == len(params) == 6 and extra == {"return_routed_experts": True}

