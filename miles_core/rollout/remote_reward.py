"""Rewards from a reward model behind HTTP (`rollout.remote_reward`): a batch of samples is
POSTed as {"prompts", "responses", "labels", "metadata"} and answered {"rewards": [...]}.

Timeouts, connection errors, 429 and 5xx are retried with exponential backoff up to
max_attempts; any other answer, or running out of attempts, fails the step with the reason.
"""

from __future__ import annotations

import logging
import math
import os
import time
from typing import Any

import requests

from miles_core.config.rollout import RemoteRewardConfig
from miles_core.errors import InfrastructureError
from miles_core.types import Prompt, Sample

log = logging.getLogger(__name__)
RETRY_STATUSES = {429, 500, 502, 503, 504}


class RemoteRewardError(InfrastructureError):
    """The reward model did not answer usably within its attempts (a rerun may find it back)."""


class RemoteRewardClient:
    def __init__(self, cfg: RemoteRewardConfig):
        self.cfg = cfg
        self.headers = {"Content-Type": "application/json"}
        if cfg.api_key_env:
            key = os.environ.get(cfg.api_key_env)
            if not key:
                raise ValueError(f"rollout.remote_reward.api_key_env: ${cfg.api_key_env} is not set")
            self.headers["Authorization"] = f"Bearer {key}"
        self.session = requests.Session()

    def score(self, samples: list[Sample], prompts: dict[int, Prompt]) -> list[float]:
        """One reward per sample, in order; prompts maps prompt_index to the sample's prompt."""
        rewards: list[float] = []
        size = self.cfg.max_batch_size
        for start in range(0, len(samples), size):
            chunk = samples[start : start + size]
            body = {"prompts": [prompts[s.prompt_index].messages for s in chunk],
                    "responses": [s.response_text for s in chunk], "labels": [s.label for s in chunk],
                    "metadata": [prompts[s.prompt_index].metadata for s in chunk]}
            rewards += self._post(body, len(chunk))
        return rewards

    def _post(self, body: dict[str, Any], expected: int) -> list[float]:
        wait, reason = self.cfg.backoff_seconds, ""
        for attempt in range(1, self.cfg.max_attempts + 1):
            try:
                resp = self.session.post(self.cfg.url, json=body, headers=self.headers,
                                         timeout=self.cfg.timeout_seconds)
            except requests.RequestException as exc:  # connection, timeout, a broken response
                reason = f"{type(exc).__name__}: {exc}"
            else:
                if resp.status_code == 200:
                    return _rewards(resp, expected, self.cfg.url)
                reason = f"HTTP {resp.status_code}: {resp.text[:200]}"
                if resp.status_code not in RETRY_STATUSES:
                    raise ValueError(f"reward model {self.cfg.url} refused the batch ({reason})")
            if attempt < self.cfg.max_attempts:
                log.warning("reward model %s attempt %d/%d failed (%s); retrying in %.1f s", self.cfg.url,
                            attempt, self.cfg.max_attempts, reason, wait)
                time.sleep(wait)
                wait *= 2
        raise RemoteRewardError(f"reward model {self.cfg.url} failed {self.cfg.max_attempts} attempts; "
                                f"last: {reason}")


def _rewards(resp: requests.Response, expected: int, url: str) -> list[float]:
    try:
        rewards = resp.json()["rewards"]
        values = [float(r) for r in rewards]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"reward model {url} answered {resp.text[:200]!r}; expected "
                         f'{{"rewards": [float, ...]}} ({type(exc).__name__})') from None
    if not all(math.isfinite(v) for v in values):
        raise ValueError(f"reward model {url} returned a non-finite reward: {values[:8]}")
    if len(values) != expected:
        raise ValueError(f"reward model {url} returned {len(values)} rewards for {expected} samples")
    return values
