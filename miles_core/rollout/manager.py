"""Rollout manager: turns a batch of prompts into scored groups of samples on N engines."""

from __future__ import annotations

import base64
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from miles_core.config import RolloutConfig
from miles_core.plugins import load_optional
from miles_core.rewards import get_reward
from miles_core.rollout.context import run_generate_fn
from miles_core.rollout.partial import append_segment, continuation_input, continuation_params, is_partial
from miles_core.rollout.remote_reward import RemoteRewardClient
from miles_core.types import Prompt, Sample, version_number

SEED_STRIDE = 1_000_003  # more samples than one batch will ever hold
SEED_MODULUS = 2**63  # SGLang refuses a sampling_seed outside int64 (SamplingParams.verify)


class RolloutManager:
    """Turns prompts into scored groups: by default it splits whole groups into one request per
    healthy engine (big batches are what make generation fast), sends them concurrently through
    the router and scores the responses; with rollout.generate, the user's function builds each
    prompt's group (miles_core.rollout.context). Then the reward, and rollout.sample_filter."""

    def __init__(self, engines: Any, rollout: RolloutConfig, reward: str, return_routed_experts: bool = False,
                 tokenizer: Any = None):
        """return_routed_experts: ask the engines for each token's experts (MoE routing replay);
        tokenizer: what a custom generate function gets as ctx.tokenizer."""
        self.engines, self.rollout, self.tokenizer = engines, rollout, tokenizer
        self.score = get_reward(reward)
        self.remote_reward = RemoteRewardClient(rollout.remote_reward) if rollout.remote_reward else None
        self.custom_generate = load_optional(rollout.generate, "rollout.generate")
        self.sample_filter = load_optional(rollout.sample_filter, "rollout.sample_filter")
        self.group_filter = load_optional(rollout.group_filter, "rollout.group_filter")
        # only sent when wanted: engines started without routed-expert support reject the flag
        self.request_extra = {"return_routed_experts": True} if return_routed_experts else {}
        self.pool = ThreadPoolExecutor(max_workers=max(2, 2 * rollout.num_engines), thread_name_prefix="rollout")

    def sampling_params(self, seeds: list[int], max_new_tokens: int | None = None) -> list[dict[str, Any]]:
        """One set per sample: SGLang samples each request with its own sampling_seed, so one
        seed shared by a group's n samples would make them n copies of one sample.
        max_new_tokens: a prompt's own budget (Prompt.max_new_tokens); None: rollout.max_new_tokens."""
        shared = {"temperature": self.rollout.temperature, "top_p": self.rollout.top_p,
                  "max_new_tokens": max_new_tokens or self.rollout.max_new_tokens}
        if self.rollout.ignore_eos:  # only sent when set: SGLang's default, and fewer keys to compare
            shared["ignore_eos"] = True
        return [shared | {"sampling_seed": seed} for seed in seeds]

    def _seeds(self, position: int, seed: int) -> list[int]:
        n = self.rollout.num_samples_per_prompt
        return [(seed * SEED_STRIDE + position * n + j) % SEED_MODULUS for j in range(n)]

    def generate(self, prompts: list[Prompt], seed: int) -> list[Sample]:
        """n samples per prompt, grouped contiguously in prompt order, scored (and filtered). Each
        sample's seed depends only on `seed`, its prompt's position and its index in the group,
        not on how the batch is sharded; batches of nearby seeds draw no shared sample seeds."""
        if self.custom_generate is None:
            samples = self._generate_default(prompts, seed)
        else:
            samples = self._generate_custom(prompts, seed)
        self._score(samples, prompts)
        if self.sample_filter is not None:
            for sample in samples:
                if not self.sample_filter(sample):
                    sample.loss_mask = [0.0] * len(sample.response_ids)
                    sample.filtered = True
        return samples

    def continue_partial(self, samples: list[Sample], seed: int) -> list[Sample]:
        """Continue every partial sample (finish_reason abort, e.g. paused for a weight update) with
        the weights the engines hold now: prompt + response so far is re-prefilled and the new
        tokens, their log-probs and their weight version append (rollout.partial). Requests are
        grouped by remaining budget (one engine call takes one max_new_tokens); each sample gets
        a fresh seed, so its continuation does not replay the noise of its first segment. Returns
        the samples (updated in place), the finished ones scored again."""
        todo = [s for s in samples if is_partial(s)]
        by_budget: dict[int, list[tuple[Sample, dict[str, Any]]]] = {}
        for k, sample in enumerate(todo):
            seed_k = (seed * SEED_STRIDE + k) % SEED_MODULUS  # one per sample, as in generate
            params = continuation_params(self.sampling_params([seed_k], sample.max_new_tokens)[0], sample)
            if params["max_new_tokens"] <= 0:
                sample.finish_reason = "length"
            else:
                by_budget.setdefault(params["max_new_tokens"], []).append((sample, params))
        futures = [([s for s, _ in pairs], self.pool.submit(self.engines.generate,
                                                            [continuation_input(s) for s, _ in pairs],
                                                            [p for _, p in pairs]))
                   for pairs in by_budget.values()]
        for group, future in futures:
            for sample, out in zip(group, future.result()):
                append_segment(sample, out)
        done = [s for s in todo if not is_partial(s)]
        if done:
            self._score_samples(done)
        return samples

    def keep_groups(self, samples: list[Sample]) -> list[bool]:
        """rollout.group_filter's verdict on each group of n (all kept without one)."""
        n = self.rollout.num_samples_per_prompt
        groups = [samples[i : i + n] for i in range(0, len(samples), n)]
        return [bool(self.group_filter(g)) if self.group_filter else True for g in groups]

    def _generate_default(self, prompts: list[Prompt], seed: int) -> list[Sample]:
        """One request per engine shard, split further by per-prompt budget: an engine call takes
        one max_new_tokens (the embedded engine refuses params that differ in more than the seed)."""
        n = self.rollout.num_samples_per_prompt
        num_shards = max(1, min(len(prompts), self.engines.num_healthy))
        requests = []
        for i in range(num_shards):
            for positions in _by_budget(list(range(len(prompts)))[i::num_shards], prompts):
                params = [q for p in positions
                          for q in self.sampling_params(self._seeds(p, seed), prompts[p].max_new_tokens)]
                ids = [prompts[p].input_ids for p in positions for _ in range(n)]
                requests.append((positions, self.pool.submit(self.engines.generate, ids, params, **self.request_extra)))
        by_position: dict[int, list[Sample]] = {}
        for positions, future in requests:
            for j, out in enumerate(future.result()):
                position = positions[j // n]
                by_position.setdefault(position, []).append(self._sample(prompts[position], out))
        return [s for position in range(len(prompts)) for s in by_position[position]]

    def _generate_custom(self, prompts: list[Prompt], seed: int) -> list[Sample]:
        """rollout.generate once per prompt, all concurrently (their engine calls merged)."""
        if self.tokenizer is None:
            raise ValueError("rollout.generate needs the run's tokenizer: pass tokenizer= to RolloutManager")
        params = [self.sampling_params(self._seeds(position, seed), prompt.max_new_tokens)
                  for position, prompt in enumerate(prompts)]
        groups = run_generate_fn(self.custom_generate, self.engines, prompts, params, self.tokenizer, self.pool,
                                 self.request_extra)
        n = self.rollout.num_samples_per_prompt
        for prompt, group in zip(prompts, groups):
            if not isinstance(group, list) or len(group) != n or not all(isinstance(s, Sample) for s in group):
                raise ValueError(f"rollout.generate returned {type(group).__name__} of "
                                 f"{len(group) if isinstance(group, list) else '?'} for prompt {prompt.index}; "
                                 f"it must return a list of num_samples_per_prompt={n} Samples")
            for sample in group:
                problem = _sample_problem(sample, group)
                if problem:
                    raise ValueError(f"rollout.generate, prompt {prompt.index}: {problem}")
        return [s for group in groups for s in group]

    def _score_samples(self, samples: list[Sample]) -> None:
        """Score continued samples (their prompts' metadata is not at hand: local rewards only)."""
        if self.remote_reward is not None:
            raise NotImplementedError("rollout.partial with rollout.remote_reward: continued samples are scored "
                                      "without their prompts' metadata; use a local reward")
        for sample in samples:
            sample.reward = float(self.score(sample.response_text, sample.label))

    def _score(self, samples: list[Sample], prompts: list[Prompt]) -> None:
        if self.remote_reward is not None:
            by_index = {p.index: p for p in prompts}
            rewards = self.remote_reward.score(samples, by_index)
        else:
            rewards = [self.score(s.response_text, s.label) for s in samples]
        for sample, reward in zip(samples, rewards):
            sample.reward = float(reward)

    def _sample(self, prompt: Prompt, out: dict[str, Any]) -> Sample:
        meta = out["meta_info"]
        logprobs = [entry[0] for entry in meta.get("output_token_logprobs", [])]
        ids = list(out["output_ids"])
        return Sample(prompt_index=prompt.index, prompt_ids=prompt.input_ids, response_ids=ids,
                      label=prompt.label, response_text=out["text"], rollout_logprobs=logprobs,
                      weight_version=str(meta["weight_version"]), finish_reason=meta["finish_reason"]["type"],
                      token_weight_versions=[version_number(meta["weight_version"])] * len(ids),
                      routed_experts=self._routed_experts(prompt, out), max_new_tokens=prompt.max_new_tokens)

    def _routed_experts(self, prompt: Prompt, out: dict[str, Any]) -> np.ndarray | None:
        if not self.request_extra:
            return None
        value = out["meta_info"].get("routed_experts")
        if value is None:  # e.g. an aborted request; the trainer refuses to replay such a sample
            return None
        return decode_routed_experts(value, len(prompt.input_ids) + len(out["output_ids"]) - 1)


def _by_budget(positions: list[int], prompts: list[Prompt]) -> list[list[int]]:
    """positions split by their prompt's budget (first-seen order; one list when none has its own)."""
    groups: dict[int | None, list[int]] = {}
    for p in positions:
        groups.setdefault(prompts[p].max_new_tokens, []).append(p)
    return list(groups.values())


def decode_routed_experts(value: Any, num_positions: int) -> np.ndarray:
    """meta_info.routed_experts as int32 [num_positions, ...]: SGLang sends base64 of a flat int32
    buffer (shape [num_positions, num_layers * top_k] here: the layer count is not in the
    response), the embedded engine a nested list [num_positions, num_layers, top_k]."""
    if isinstance(value, str):
        flat = np.frombuffer(base64.b64decode(value), dtype=np.int32)
        if num_positions <= 0 or flat.size % num_positions:
            raise ValueError(f"routed_experts holds {flat.size} ids, not a multiple of {num_positions} positions")
        return flat.reshape(num_positions, -1).copy()
    array = np.asarray(value, dtype=np.int32)
    if len(array) != num_positions:
        raise ValueError(f"routed_experts covers {len(array)} positions, expected {num_positions}")
    return array


def _sample_problem(sample: Sample, group: list[Sample]) -> str | None:
    """What would make a custom generate's sample train wrongly (None when nothing)."""
    size = len(sample.response_ids)
    if not sample.prompt_ids or not size:
        return "a sample needs prompt_ids and response_ids"
    for name in ("loss_mask", "rollout_logprobs"):
        if len(getattr(sample, name)) not in (0, size):
            return f"{name} has {len(getattr(sample, name))} entries for {size} response tokens"
    if sum(s is sample for s in group) > 1:
        return "the same Sample object appears twice in the group (rewards and masks would be shared)"
    return None

