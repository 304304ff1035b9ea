"""SGLang's `retract` pause for the embedded engine: the pieces `EngineService.generate` uses.

SGLang (scheduler.pause_generation): `abort` ends running and queued requests, which return what
they have with finish_reason abort; `retract` takes the running requests off the batch, frees
their KV and puts them back in the waiting queue, so after /continue_generation each is prefilled
again (prompt + tokens so far) with the weights held then and its new tokens append: the client
sees one response; `in_place` only stops scheduling and keeps the running batch and its KV.

The embedded engine retracts the same way: its running call ends between decode steps (the
`interrupted` hook), the tokens so far are kept, and after continue the unfinished rows run again
from prompt + tokens so far. In-place is not done: KV kept across a weight update was computed by
the old weights (SGLang's own flush_cache rule; NeMo-RL refuses in_place for weight updates for
that reason), and one transformers call cannot be suspended anyway.
"""

from __future__ import annotations

SEED_MIX = 1_000_003


def unfinished_rows(outs: list[dict], max_new_tokens: int) -> list[int]:
    """Rows a retract cut short: ended by length before their budget."""
    return [i for i, out in enumerate(outs)
            if out["meta_info"]["finish_reason"]["type"] == "length" and len(out["output_ids"]) < max_new_tokens]


def continuation_seed(seed: int, done_tokens: int) -> int:
    """A seeded row's seed for its continuation: the embedded engine's noise is drawn from (seed,
    step, token) with steps counted from 0 in each call, so the same seed would replay the noise
    of the first segment's steps."""
    return (seed * SEED_MIX + done_tokens) % 2**63


def merge_continuation(first: dict, more: dict, budget: int, tokenizer) -> dict:
    """One response from a retracted row's outputs before and after the retract. `budget` is the
    row's remaining max_new_tokens: the continuation ran with the batch's largest, so its tokens
    are cut to the row's own (a causal row's tokens do not depend on a longer budget)."""
    ids, meta = more["output_ids"][:budget], more["meta_info"]
    all_ids = first["output_ids"] + ids
    merged = dict(first["meta_info"])
    cut = len(more["output_ids"]) > budget or meta["finish_reason"]["type"] == "length"
    finish = {"type": "length", "length": len(first["output_ids"]) + budget} if cut else meta["finish_reason"]
    merged.update(weight_version=meta["weight_version"], completion_tokens=len(all_ids), finish_reason=finish)
    if "output_token_logprobs" in first["meta_info"]:
        merged["output_token_logprobs"] = (first["meta_info"]["output_token_logprobs"]
                                           + meta.get("output_token_logprobs", [])[:budget])
    if "routed_experts" in meta:  # the continuation's pass covers prompt + every token
        merged["routed_experts"] = meta["routed_experts"][: merged["prompt_tokens"] + len(all_ids) - 1]
    return {"text": tokenizer.decode(all_ids, skip_special_tokens=True), "output_ids": all_ids, "meta_info": merged}
