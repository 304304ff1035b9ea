"""Helpers several test modules share (test modules never import each other)."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

from miles_core.types import Sample


def with_tokenizer(model, source: Path, out: Path) -> Path:
    """Save `model` to `out` with the tokenizer files of the model directory `source`."""
    model.save_pretrained(out)
    for path in source.iterdir():
        if path.name not in ("config.json", "generation_config.json", "model.safetensors"):
            shutil.copy2(path, out / path.name)
    return out


def random_samples(n: int = 8, seed: int = 0) -> list[Sample]:
    """n samples of random token ids in pairs per prompt, rewards alternating 0/1."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(5, 80) for _ in range(rng.randrange(4, 8))]
        response = [rng.randrange(5, 80) for _ in range(rng.randrange(2, 6))]
        out.append(Sample(prompt_index=i // 2, prompt_ids=prompt, response_ids=response, label="",
                          reward=float(i % 2), rollout_logprobs=[-2.0] * len(response)))
    return out


def max_abs_diff(a: list[list[float]], b: list[list[float]]) -> float:
    """The largest element-wise difference of two ragged lists (per-token log-probs)."""
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))
