"""Partial rollouts (issue 42): samples paused mid-generation and continued after a weight update.

A paused sample keeps the tokens it has (ids, the behaviour log-prob of each, and the weight
version of each). Continuing it is a new request whose input is prompt + those tokens and whose
budget is what is left of max_new_tokens: the engine re-prefills that input with the weights it
holds now and the new tokens append. Each token's log-prob is the one of the policy that sampled
it, so the off-policy correction (TIS/MIS) compares the trainer against exactly that policy, token
by token, across the segments.

Why not SGLang's `in_place` pause: it freezes the running batch with its KV cache, and after a
weight update that KV (and the radix cache's prefixes) was computed by the old weights, so the new
tokens would attend to stale keys and values: neither policy's tokens, and log-probs no trainer
forward reproduces. SGLang's own check: an update with flush_cache=false keeps such prefixes, which
is why the embedded engine refuses to generate until /flush_cache (engines/embedded/service.py, stale_cache_version).
Re-prefilling costs one prefill of the partial response and keeps every log-prob exact.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from miles_core.types import Sample, is_mixed_version, token_versions, version_number

ABORT = "abort"


def is_partial(sample: Sample) -> bool:
    """A sample the engine returned unfinished (paused or aborted), to be continued."""
    return sample.finish_reason == ABORT


def continuation_input(sample: Sample) -> list[int]:
    """What a continuation request sends: the prompt and the response so far (re-prefilled)."""
    return list(sample.prompt_ids) + list(sample.response_ids)


def remaining_budget(sample: Sample, max_new_tokens: int) -> int:
    """New tokens the continuation may still generate (the budget covers every segment)."""
    return max(0, max_new_tokens - len(sample.response_ids))


def continuation_params(params: dict[str, Any], sample: Sample) -> dict[str, Any]:
    """The sample's sampling params with max_new_tokens cut to what is left."""
    return params | {"max_new_tokens": remaining_budget(sample, int(params["max_new_tokens"]))}


def append_segment(sample: Sample, out: dict[str, Any]) -> Sample:
    """Append one engine response (SGLang's /generate shape) to the sample: its token ids, the
    log-prob of each as generated, and the weight version of each (the version the engine
    reported for this segment). The finish reason and weight_version become the segment's.
    Routed experts of a multi-segment sample are dropped (no replay: different passes)."""
    meta = out["meta_info"]
    ids = list(out["output_ids"])
    logprobs = [entry[0] for entry in meta.get("output_token_logprobs", [])]
    if ids and sample.response_ids and bool(sample.rollout_logprobs) != bool(logprobs):
        raise ValueError("a continued sample needs log-probs of every segment, or of none")
    if logprobs and len(logprobs) != len(ids):
        raise ValueError(f"segment has {len(logprobs)} log-probs for {len(ids)} tokens")
    previous = token_versions(sample)
    sample.response_ids = list(sample.response_ids) + ids
    sample.rollout_logprobs = list(sample.rollout_logprobs) + logprobs
    sample.token_weight_versions = previous + [version_number(meta["weight_version"])] * len(ids)
    if sample.loss_mask:
        sample.loss_mask = list(sample.loss_mask) + [1.0] * len(ids)
    sample.response_text += out.get("text", "")
    sample.weight_version = str(meta["weight_version"])
    sample.finish_reason = meta["finish_reason"]["type"]
    if len(set(sample.token_weight_versions)) > 1:
        sample.routed_experts = None
    return sample


def version_metrics(samples: list[Sample]) -> dict[str, float]:
    """Share of mixed-version samples, and response tokens per weight version counted back from
    the batch's newest (`rollout/tokens_behind_<d>`: generated d versions before it), so a long
    run logs a few metric names, not one per version it ever had."""
    if not samples:
        return {}
    per_version = Counter(v for s in samples for v in token_versions(s))
    newest = max(per_version, default=0)
    metrics = {"rollout/mixed_version_sample_frac": sum(map(is_mixed_version, samples)) / len(samples)}
    metrics |= {f"rollout/tokens_behind_{newest - v}": float(n) for v, n in sorted(per_version.items())}
    return metrics
