"""Held-out evaluation through the same engine code that generates rollouts.

`evaluate_dataset` samples n responses per prompt and reports pass@k with the unbiased
estimator of Chen et al. (2021), `evaluate_all` covers every dataset of a recipe,
`evaluate_on_engines` runs it on rollout engines in the Ray cluster (what the flows do: SGLang
on GPU clusters, the embedded engine locally), and `run_external_eval` delegates to a user
command (eval.mode=external_command).
"""

from __future__ import annotations

import functools
import json
import shlex
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from miles_core.config import RunConfig
from miles_core.data import read_prompts
from miles_core.metrics import HELDOUT, eval_metric_name
from miles_core.plugins import load_plugin
from miles_core.rewards import get_reward
from miles_core.rollout.context import run_generate_fn
from miles_core.rollout.router import generate_in_shards
from miles_core.types import EvalResult, Prompt

MAX_EXAMPLES = 8
EvalResults = dict[str, EvalResult]
"""{dataset name: its EvalResult}; the held-out set is HELDOUT."""


class ExternalEvalError(RuntimeError):
    """The external evaluation command failed, timed out, or wrote no usable JSON."""


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k).

    Computed as 1 - prod_{i=n-c+1..n} (1 - k/i): the binomials overflow floats for large n,
    the product stays in [0, 1].
    """
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 1 <= k <= n (k samples drawn out of n), got n={n}, k={k}")
    if n - c < k:  # every k-subset contains a correct sample
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


class EngineAsGroup:
    """One in-process engine as the slice of an EngineGroup that RolloutManager and a generate
    function's ctx (miles_core.rollout.context) call: no router, no actors."""

    num_healthy = 1

    def __init__(self, engine: Any):
        self.engine = engine

    def generate(self, input_ids: list[list[int]], sampling_params: list[dict], **extra: Any) -> list[dict]:
        return self.engine.generate(input_ids, sampling_params, return_logprob=True, **extra)


def _generate_episodes(generate_fn: Callable, engine, prompts: list[Prompt], params: dict, num_samples: int,
                       seed: int | None) -> list[list[str]]:
    """rollout.generate's episodes: the final response_text of each of num_samples per prompt."""
    seeds = [[(seed or 0) + i * num_samples + j for j in range(num_samples)] for i in range(len(prompts))]
    per_prompt = [[params | {"sampling_seed": s} for s in row] for row in seeds]
    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="eval") as pool:
        groups = run_generate_fn(generate_fn, EngineAsGroup(engine), prompts, per_prompt, engine.tokenizer, pool)
    return [[sample.response_text for sample in group] for group in groups]


def _generate_all(engine, prompts: list[Prompt], params: dict, num_samples: int,
                  batch_size: int, seed: int | None) -> list[list[str]]:
    """num_samples response texts per prompt; a batch holds batch_size sequences."""
    flat = [p for p in prompts for _ in range(num_samples)]
    texts: list[str] = []
    for start in range(0, len(flat), batch_size):
        chunk = flat[start : start + batch_size]
        # Row i of the batch samples with seed + i: a distinct, reproducible seed per sequence
        # (same seed -> same samples on a rerun); no seed argument for engines that take none.
        seeding = {} if seed is None else {"seed": seed + start}
        outputs = engine.generate([p.input_ids for p in chunk], params, return_logprob=False, **seeding)
        texts.extend(out["text"] for out in outputs)
    return [texts[i * num_samples : (i + 1) * num_samples] for i in range(len(prompts))]


def evaluate_dataset(engine, prompts: list[Prompt], reward: str, *, num_samples: int = 1,
                     temperature: float = 0.0, top_p: float = 1.0, max_new_tokens: int,
                     batch_size: int, pass_k: Sequence[int] = (1,), seed: int | None = None,
                     generate_fn: Callable | None = None) -> EvalResult:
    """pass@1, pass@k (each requested k <= n), avg@n and a few examples of one dataset.

    A response is correct when its reward is > 0. avg@n is the mean reward over all n
    samples of all prompts (equal to pass@1 for 0/1 rewards, not for +-1 rewards like dapo).
    generate_fn: a rollout.generate function whose episodes are scored instead.
    """
    if not prompts:
        raise ValueError("evaluate_dataset: no prompts")
    if num_samples < 1:
        raise ValueError(f"evaluate_dataset: num_samples must be >= 1, got {num_samples}")
    if temperature == 0 and num_samples != 1:
        raise ValueError(f"greedy decoding (temperature=0) gives one response per prompt, but num_samples="
                         f"{num_samples}: set temperature > 0 or num_samples_per_prompt=1")
    score = get_reward(reward)
    params = {"temperature": float(temperature), "top_p": float(top_p), "max_new_tokens": int(max_new_tokens)}
    responses = (_generate_all(engine, prompts, params, num_samples, batch_size, seed) if generate_fn is None
                 else _generate_episodes(generate_fn, engine, prompts, params, num_samples, seed))
    rewards = [[float(score(text, p.label)) for text in texts] for p, texts in zip(prompts, responses)]
    correct = [sum(r > 0 for r in row) for row in rewards]
    return EvalResult(
        pass_at_k={k: sum(pass_at_k(num_samples, c, k) for c in correct) / len(prompts)
                   for k in sorted({1, *pass_k}) if k <= num_samples},
        mean_reward_at_n={num_samples: sum(map(sum, rewards)) / (len(prompts) * num_samples)},
        num_prompts=len(prompts), num_samples_per_prompt=num_samples,
        examples=[{"prompt": p.messages, "label": p.label, "responses": texts, "rewards": row}
                  for p, texts, row in list(zip(prompts, responses, rewards))[:MAX_EXAMPLES]])


def evaluate_greedy(engine, prompts: list[Prompt], reward: str, max_new_tokens: int,
                    batch_size: int) -> EvalResult:
    """pass@1 of greedy decoding: the fraction of prompts whose response scores > 0 (no avg@n,
    one response per example row)."""
    result = evaluate_dataset(engine, prompts, reward, max_new_tokens=max_new_tokens, batch_size=batch_size)
    examples = [{"prompt": e["prompt"], "response": e["responses"][0], "label": e["label"],
                 "correct": e["rewards"][0] > 0} for e in result.examples]
    return EvalResult(pass_at_k={1: result.pass_at_1}, num_prompts=result.num_prompts, examples=examples)


def evaluate_all(cfg: RunConfig, model_dir: str | Path | None, default_eval_path: str | Path,
                 external_timeout_seconds: float = 3600, engine: Any = None) -> EvalResults:
    """{dataset name: result} for the held-out set ("heldout") and every eval.datasets entry.

    Generates on `engine` when given (e.g. the run's rollout engines), else on an engine
    built from model_dir, or through eval.external_command.
    """
    names = [d.name for d in cfg.eval.datasets]
    if HELDOUT in names or len(set(names)) != len(names):
        raise ValueError(f"eval.datasets names must be unique and not {HELDOUT!r} (the default held-out set): {names}")
    if engine is None and cfg.eval.mode == "external_command":
        if not cfg.eval.external_command:
            raise ValueError("eval.mode=external_command needs eval.external_command")
        with tempfile.TemporaryDirectory(prefix="miles-eval-") as tmp:
            metrics = run_external_eval(cfg.eval.external_command, str(model_dir), str(Path(tmp) / "eval.json"),
                                        external_timeout_seconds)
        return {HELDOUT: metrics}
    if engine is None:
        from miles_core.engines.embedded.engine import EmbeddedEngine  # torch + transformers: only when generating

        engine = EmbeddedEngine(str(model_dir), cfg.model.dtype, cfg.training.num_threads)
    tokenizer = engine.tokenizer
    e = cfg.eval
    generate_fn = load_plugin(cfg.rollout.generate, "rollout.generate") if e.use_rollout_generate else None
    results = {HELDOUT: evaluate_dataset(
        engine, read_prompts(default_eval_path, cfg.data, tokenizer), cfg.rollout.reward,
        max_new_tokens=e.max_new_tokens, batch_size=e.batch_size, pass_k=e.pass_k, seed=cfg.seed,
        generate_fn=generate_fn)}
    for ds in e.datasets:
        results[ds.name] = evaluate_dataset(
            engine, read_prompts(ds.path, cfg.data, tokenizer), ds.reward or cfg.rollout.reward,
            num_samples=ds.num_samples_per_prompt, temperature=ds.temperature, top_p=ds.top_p,
            max_new_tokens=ds.max_new_tokens or e.max_new_tokens, batch_size=e.batch_size,
            pass_k=e.pass_k, seed=cfg.seed, generate_fn=generate_fn)
    return results


class EngineGroupEval:
    """The `engine.generate(...)` that evaluation expects, spread over an EngineGroup's
    healthy engines (one shard per engine, sent concurrently)."""

    def __init__(self, engines: Any, tokenizer: Any):
        self.engines, self.tokenizer = engines, tokenizer
        self.pool = ThreadPoolExecutor(max_workers=max(2, engines.cfg.rollout.num_engines), thread_name_prefix="eval")

    def generate(self, input_ids: list[list[int]], params: dict | list[dict], return_logprob: bool = False,
                 seed: int | None = None) -> list[dict]:
        """Row i samples with seed + i (one sampling_seed per request, as SGLang takes them);
        params may also be one dict per row, seeds included."""
        if isinstance(params, list):
            per_row = params
        else:
            per_row = [params if seed is None else params | {"sampling_seed": seed + i} for i in range(len(input_ids))]
        generate = functools.partial(self.engines.router.generate, return_logprob=return_logprob)
        return generate_in_shards(self.pool, generate, input_ids, per_row, self.engines.num_healthy)

    def close(self) -> None:
        self.pool.shutdown(wait=True)


def evaluate_on_engines(cfg: RunConfig, model_dir: str | Path, default_eval_path: str | Path) -> EvalResults:
    """evaluate_all on rollout engines started for it in the Ray cluster (rollout.engine and
    rollout.num_engines of the recipe), stopped afterwards: generation never runs in the
    calling process, which on a cluster has no GPU. external_command evals run the command."""
    if cfg.eval.mode == "external_command":
        return evaluate_all(cfg, model_dir, default_eval_path)
    from transformers import AutoTokenizer

    from miles_core.rollout.engine_group import EngineGroup

    engines = EngineGroup(cfg, str(model_dir))
    client = EngineGroupEval(engines, AutoTokenizer.from_pretrained(str(model_dir)))
    try:
        return evaluate_all(cfg, model_dir, default_eval_path, engine=client)
    finally:
        client.close()
        engines.shutdown()


def _tail(text: str | bytes | None, chars: int = 2000) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return (text or "")[-chars:]


def run_external_eval(command: str, model_dir: str, output_json_path: str,
                      timeout_seconds: float) -> EvalResult:
    """Run `command` (placeholders {model_dir}, {output_json}) and read the metrics it writes.

    The command is split with shlex and run without a shell, and placeholders are replaced
    inside each argument, so paths with spaces or quotes stay one argument.
    """
    args = [a.replace("{model_dir}", str(model_dir)).replace("{output_json}", str(output_json_path))
            for a in shlex.split(command)]
    if not args:
        raise ExternalEvalError("eval.external_command is empty")
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout_seconds)
    except subprocess.TimeoutExpired as exc:
        raise ExternalEvalError(f"external eval {args[0]!r} timed out after {timeout_seconds:g} s; "
                                f"stderr tail:\n{_tail(exc.stderr)}") from None
    except OSError as exc:
        raise ExternalEvalError(f"external eval {args[0]!r} could not start: {exc}") from None
    if proc.returncode != 0:
        raise ExternalEvalError(f"external eval {args[0]!r} exited with {proc.returncode}; "
                                f"stderr tail:\n{_tail(proc.stderr)}")
    try:
        metrics = json.loads(Path(output_json_path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ExternalEvalError(f"external eval {args[0]!r} succeeded but {output_json_path} is missing or not "
                                f"JSON ({exc}); stderr tail:\n{_tail(proc.stderr)}") from None
    try:
        return EvalResult.from_json(metrics)
    except (AttributeError, ValueError):  # not an object, or no numeric pass@1
        raise ExternalEvalError(f"external eval wrote {str(metrics)[:200]!r}; "
                                "expected an object with a numeric 'pass@1'") from None


# ---- metric names (MLflow keys) --------------------------------------------------------------
def by_dataset(results: EvalResults | EvalResult | None) -> EvalResults:
    """Accept {name: result} or one bare result (e.g. evaluate_greedy's) as the held-out set."""
    if not results:
        return {}
    return {HELDOUT: results} if isinstance(results, EvalResult) else dict(results)


def eval_metrics(phase: str, results: EvalResults | EvalResult | None) -> dict[str, float]:
    """{eval/<phase>/<dataset>/pass_at_k: value} for every pass@k / avg@n of every dataset."""
    return {eval_metric_name(phase, name, m): v for name, r in by_dataset(results).items()
            for m, v in r.metrics().items()}
