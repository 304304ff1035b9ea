"""Rollout manager: turns a batch of prompts into scored groups of samples on N engines."""

from __future__ import annotations

from typing import Any

import ray

from miles_core.config import RolloutConfig
from miles_core.data import Prompt, Sample
from miles_core.rewards import get_reward


class RolloutManager:
    """Fans groups out over engine actors (whole groups per engine), collects and scores."""

    def __init__(self, engines: list[Any], rollout: RolloutConfig, reward: str):
        self.engines, self.rollout, self.score = engines, rollout, get_reward(reward)

    def sampling_params(self) -> dict[str, Any]:
        return {"temperature": self.rollout.temperature, "top_p": self.rollout.top_p,
                "max_new_tokens": self.rollout.max_new_tokens}

    def generate(self, prompts: list[Prompt], seed: int) -> list[Sample]:
        """n samples per prompt, grouped contiguously in prompt order, with rewards."""
        n, params = self.rollout.num_samples_per_prompt, self.sampling_params()
        indexed = list(enumerate(prompts))
        shards = [indexed[rank :: len(self.engines)] for rank in range(len(self.engines))]
        work = [(rank, shard) for rank, shard in enumerate(shards) if shard]
        futures = [self.engines[rank].generate.remote([p.input_ids for _, p in shard for _ in range(n)],
                                                      params, True, seed + rank)
                   for rank, shard in work]
        samples: list[Sample | None] = [None] * (len(prompts) * n)
        for (_, shard), outputs in zip(work, ray.get(futures)):
            for j, out in enumerate(outputs):
                position, prompt = shard[j // n]
                samples[position * n + j % n] = self._sample(prompt, out)
        return samples

    def _sample(self, prompt: Prompt, out: dict[str, Any]) -> Sample:
        meta = out["meta_info"]
        logprobs = [entry[0] for entry in meta.get("output_token_logprobs", [])]
        return Sample(prompt_index=prompt.index, prompt_ids=prompt.input_ids, response_ids=list(out["output_ids"]),
                      label=prompt.label, response_text=out["text"], rollout_logprobs=logprobs,
                      reward=self.score(out["text"], prompt.label), weight_version=meta["weight_version"],
                      finish_reason=meta["finish_reason"]["type"])
