"""Building a sample turn by turn, token in / token out: what a multi-turn generate function
(tool calls, feedback, self-correction) appends to.

Turns are appended as token ids, never re-tokenised from text: the trainer then scores exactly
the tokens the engine sampled, and the rollout log-probs stay aligned with them. Tokens the
policy generated are trained on (loss mask 1, the engine's log-prob kept); tokens the
environment adds (tool results, feedback, the next turn's header) are context only (mask 0).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from miles_core.types import Prompt, Sample


@dataclass
class Trajectory:
    prompt: Prompt
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[float] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    weight_version: str = ""
    finish_reason: str = "stop"
    num_turns: int = 0

    @property
    def input_ids(self) -> list[int]:
        """The whole sequence so far: the next turn's prompt."""
        return self.prompt.input_ids + self.response_ids

    def add_generated(self, output: dict[str, Any]) -> None:
        """Append one engine output (SGLang's /generate response for one prompt, asked with
        return_logprob): its tokens are trained on, with their log-probs."""
        ids = list(output["output_ids"])
        meta = output["meta_info"]
        logprobs = [entry[0] for entry in meta.get("output_token_logprobs", [])]
        if len(logprobs) != len(ids):
            raise ValueError(f"the engine returned {len(logprobs)} log-probs for {len(ids)} tokens: "
                             "generate with return_logprob (ctx.generate does)")
        self.response_ids += ids
        self.loss_mask += [1.0] * len(ids)
        self.logprobs += logprobs
        self.weight_version = str(meta["weight_version"])
        self.finish_reason = meta["finish_reason"]["type"]
        self.num_turns += 1

    def add_observation(self, ids: list[int]) -> None:
        """Append tokens the policy did not generate (a tool result, feedback): context only."""
        self.response_ids += list(ids)
        self.loss_mask += [0.0] * len(ids)
        self.logprobs += [0.0] * len(ids)

    def to_sample(self, response_text: str) -> Sample:
        """The finished sample; response_text is what the reward function scores."""
        if not self.num_turns:
            raise ValueError("a trajectory needs at least one generated turn")
        return Sample(prompt_index=self.prompt.index, prompt_ids=self.prompt.input_ids,
                      response_ids=list(self.response_ids), label=self.prompt.label, response_text=response_text,
                      rollout_logprobs=list(self.logprobs), loss_mask=list(self.loss_mask),
                      weight_version=self.weight_version, finish_reason=self.finish_reason)
