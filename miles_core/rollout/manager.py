"""Rollout manager: turns a batch of prompts into scored groups of samples on N engines."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

from miles_core.config import RolloutConfig
from miles_core.data import Prompt, Sample
from miles_core.rewards import get_reward


class RolloutManager:
    """Splits whole groups into one request per healthy engine (big batches are what make
    generation fast), sends them concurrently through the router, scores the responses."""

    def __init__(self, engines: Any, rollout: RolloutConfig, reward: str):
        self.engines, self.rollout, self.score = engines, rollout, get_reward(reward)
        self.pool = ThreadPoolExecutor(max_workers=max(2, 2 * rollout.num_engines), thread_name_prefix="rollout")

    def sampling_params(self, seed: int) -> dict[str, Any]:
        return {"temperature": self.rollout.temperature, "top_p": self.rollout.top_p,
                "max_new_tokens": self.rollout.max_new_tokens, "sampling_seed": seed}

    def generate(self, prompts: list[Prompt], seed: int) -> list[Sample]:
        """n samples per prompt, grouped contiguously in prompt order, with rewards."""
        n = self.rollout.num_samples_per_prompt
        num_shards = max(1, min(len(prompts), self.engines.num_healthy))
        shards = [prompts[i::num_shards] for i in range(num_shards)]
        futures = [self.pool.submit(self.engines.generate, [p.input_ids for p in shard for _ in range(n)],
                                    self.sampling_params(seed + i)) for i, shard in enumerate(shards)]
        by_position: dict[int, list[Sample]] = {}
        for i, (shard, future) in enumerate(zip(shards, futures)):
            outputs = future.result()
            for j, out in enumerate(outputs):
                by_position.setdefault(i + (j // n) * num_shards, []).append(self._sample(shard[j // n], out))
        return [s for position in range(len(prompts)) for s in by_position[position]]

    def _sample(self, prompt: Prompt, out: dict[str, Any]) -> Sample:
        meta = out["meta_info"]
        logprobs = [entry[0] for entry in meta.get("output_token_logprobs", [])]
        return Sample(prompt_index=prompt.index, prompt_ids=prompt.input_ids, response_ids=list(out["output_ids"]),
                      label=prompt.label, response_text=out["text"], rollout_logprobs=logprobs,
                      reward=self.score(out["text"], prompt.label), weight_version=str(meta["weight_version"]),
                      finish_reason=meta["finish_reason"]["type"])
