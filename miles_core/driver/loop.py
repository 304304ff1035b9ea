"""The RL loop: rollout -> reward -> train -> weight sync, under a rollout schedule
(sync, one-step-off or fully async; see miles_core.driver.schedules).

Runs in the driver process; trainer and engines are Ray actors. Resumable: everything the
next step depends on (weights, optimizer, data cursor, RNG, step, weight version) is in the
latest complete checkpoint.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from typing import TYPE_CHECKING, Any

import ray
import torch

from miles_core import algorithms as algo
from miles_core.config import RunConfig
from miles_core.data import PromptSource, sft_samples
from miles_core.driver.schedules import SCHEDULES, RolloutBatch, timed
from miles_core.driver.time_sharing import time_sharing
from miles_core.metrics import (
    ASYNC_DROPPED_TOKENS,
    PARTIAL_TOKENS_THROWN_AWAY,
    REWARD_MEAN,
    STEP_SECONDS,
    TOKENS_UNUSED_AT_END,
    TOKENS_WASTED,
    TRAIN_LOSS,
    TRAIN_SECONDS,
)
from miles_core.rollout.manager import RolloutManager
from miles_core.rollout.partial import version_metrics
from miles_core.rollout.partial_pool import PartialPool
from miles_core.rollout.partial_state import PoolRecord, record_batch
from miles_core.rollout.router import NoHealthyEngine
from miles_core.types import Sample

if TYPE_CHECKING:
    from miles_core.driver.run import LoopState, TrainingRun

log = logging.getLogger(__name__)


def collect_rollouts(cfg: RunConfig, manager: RolloutManager, source: PromptSource, seed: int
                     ) -> tuple[list[Sample], dict[str, float]]:
    """One step's batch. With dynamic sampling, groups whose rewards are all equal carry no
    signal and are dropped; more prompts are drawn (in rounds of a full batch, groups kept in
    the order drawn) until the batch is full. When algorithm.max_sampling_rounds run out first,
    algorithm.short_batch decides: train on the shorter batch (a logged, metered decision) or fail."""
    n, wanted = cfg.rollout.num_samples_per_prompt, cfg.rollout.num_prompts_per_step
    if not cfg.algorithm.dynamic_sampling:
        samples = manager.generate(source.next_batch(wanted), seed)
        return _filter_groups(cfg, manager, samples)
    kept: list[Sample] = []
    dropped, filtered, rounds = 0, 0, 0
    while len(kept) < wanted * n and rounds < cfg.algorithm.max_sampling_rounds:
        samples = manager.generate(source.next_batch(wanted), seed + rounds * 7919)
        varied = algo.dynamic_sampling_keep(torch.tensor([s.reward for s in samples]), n).tolist()
        for group, (ok, wanted_by_filter) in enumerate(zip(varied, manager.keep_groups(samples))):
            if ok and wanted_by_filter:
                kept.extend(samples[group * n : (group + 1) * n])
            dropped += not ok
            filtered += ok and not wanted_by_filter
        rounds += 1
    kept_groups = min(len(kept) // n, wanted)
    if kept_groups < wanted:
        _short_batch(cfg, kept_groups, dropped, rounds)
    metrics = {"rollout/dropped_groups": float(dropped), "rollout/sampling_rounds": float(rounds),
               "rollout/kept_groups": float(kept_groups), "rollout/short_batch": float(kept_groups < wanted)}
    if cfg.rollout.group_filter:
        metrics["rollout/filtered_groups"] = float(filtered)
    return kept[: kept_groups * n], metrics


def _filter_groups(cfg: RunConfig, manager: RolloutManager, samples: list[Sample]
                   ) -> tuple[list[Sample], dict[str, float]]:
    """rollout.group_filter's groups dropped (without dynamic sampling: no refill)."""
    if not cfg.rollout.group_filter:
        return samples, {}
    n = cfg.rollout.num_samples_per_prompt
    keep = manager.keep_groups(samples)
    if not any(keep):
        raise RuntimeError(f"rollout.group_filter dropped all {len(keep)} groups of the batch: nothing to train "
                           "on; check the filter, or enable algorithm.dynamic_sampling to draw more prompts")
    kept = [s for group, ok in enumerate(keep) if ok for s in samples[group * n : (group + 1) * n]]
    return kept, {"rollout/filtered_groups": float(keep.count(False))}


def _short_batch(cfg: RunConfig, kept_groups: int, dropped: int, rounds: int) -> None:
    a, wanted = cfg.algorithm, cfg.rollout.num_prompts_per_step
    what = (f"dynamic sampling kept {kept_groups} of {wanted} groups after {rounds} rounds "
            f"({dropped} groups had all-equal rewards)")
    if kept_groups == 0 or a.short_batch == "fail":
        raise RuntimeError(f"{what}; raise algorithm.max_sampling_rounds, or set algorithm.short_batch=train to "
                           "train on a shorter batch, or disable algorithm.dynamic_sampling")
    log.warning("%s: training on the shorter batch (algorithm.short_batch=train)", what)


def rollout_metrics(cfg: RunConfig, samples: list[Sample]) -> dict[str, float]:
    n = cfg.rollout.num_samples_per_prompt
    rewards = [s.reward for s in samples]
    groups = [rewards[i : i + n] for i in range(0, len(rewards), n)]
    return {
        REWARD_MEAN: statistics.fmean(rewards),
        "rollout/reward_std": statistics.pstdev(rewards),
        "rollout/response_len_mean": statistics.fmean(len(s.response_ids) for s in samples),
        "rollout/truncated_frac": statistics.fmean(s.finish_reason == "length" for s in samples),
        "rollout/zero_std_group_frac": statistics.fmean(len(set(g)) == 1 for g in groups),
    } | version_metrics(samples) | ({"rollout/filtered_sample_frac": statistics.fmean(s.filtered for s in samples)}
         if cfg.rollout.sample_filter else {})


def throughput(batch: RolloutBatch, train_seconds: float) -> dict[str, float]:
    """Generated tokens per second of rollout, trained (prompt + response) tokens per second."""
    generated = sum(len(s.response_ids) for s in batch.samples)
    trained = generated + sum(len(s.prompt_ids) for s in batch.samples)
    return {"rollout/tokens_per_second": generated / max(batch.seconds, 1e-9),
            "train/tokens_per_second": trained / max(train_seconds, 1e-9)}


def tokens_wasted(metrics: dict[str, float]) -> dict[str, float]:
    """TOKENS_WASTED from a batch's metrics: stale batches the fully async loop dropped plus partial
    groups thrown away (each absent, so 0, where the schedule never wastes any)."""
    return {TOKENS_WASTED: metrics.get(ASYNC_DROPPED_TOKENS, 0.0) + metrics.get(PARTIAL_TOKENS_THROWN_AWAY, 0.0)}


def unused_at_end(schedule, pool: PartialPool | None) -> dict[str, float]:
    """TOKENS_UNUSED_AT_END of a schedule whose producer has stopped (close()); {} for the
    schedules that generate nothing ahead of the last step."""
    if not hasattr(schedule, "unconsumed"):
        return {}
    samples = [s for batch in schedule.unconsumed() for s in batch.samples]
    if pool is not None:
        samples += [s for group in pool.pending + pool.done for s in group]
    return {TOKENS_UNUSED_AT_END: float(sum(len(s.response_ids) for s in samples))}


def make_producer(run: TrainingRun, manager: RolloutManager):
    """(step, engine version) -> RolloutBatch: RL rollouts, or dataset labels for SFT.
    When every engine is down, they are restarted at the batch's weight version and the batch
    is generated again from the same prompts."""
    cfg, source = run.cfg, run.source

    def produce(step: int, version: int) -> RolloutBatch:
        if cfg.algorithm.name == "sft":
            samples = sft_samples(source.next_batch(cfg.rollout.num_prompts_per_step), run.tokenizer,
                                  cfg.data.solution_key)
            return RolloutBatch(samples, {}, version, source.state_dict())
        cursor = source.state_dict()
        try:
            samples, sampling = collect_rollouts(cfg, manager, source, seed=cfg.seed * 100_003 + step * 97)
        except NoHealthyEngine:
            log.warning("no healthy engine during the rollout of step %d; restarting engines", step + 1)
            run.engines.heal()
            run.push_weights(version)
            source.load_state_dict(cursor)
            samples, sampling = collect_rollouts(cfg, manager, source, seed=cfg.seed * 100_003 + step * 97)
        versions = {s.weight_version for s in samples}
        if versions != {str(version)}:  # weights changed mid-generation: a correctness bug, never retried
            raise RuntimeError(f"batch for step {step} mixes weight versions {versions}, expected {version}")
        return RolloutBatch(samples, rollout_metrics(cfg, samples) | sampling, version, source.state_dict())

    return timed(produce)


def train_on(cfg: RunConfig, trainer: Any, batch: RolloutBatch) -> dict[str, float]:
    started = time.perf_counter()
    if cfg.algorithm.name == "sft":
        metrics = {TRAIN_LOSS: ray.get(trainer.sft_step.remote(batch.samples))}
    else:
        metrics = ray.get(trainer.train_step.remote(batch.samples))
    if not math.isfinite(metrics[TRAIN_LOSS]):  # permanent: a retry would diverge again
        raise FloatingPointError(f"non-finite loss: {metrics[TRAIN_LOSS]}; lower training.lr or check the rewards")
    return metrics | {TRAIN_SECONDS: time.perf_counter() - started}


def make_partial_producer(run: TrainingRun, manager: RolloutManager, pool: PartialPool | None = None):
    """rollout.partial: (step, engine version) -> a batch of num_prompts_per_step finished groups,
    or None when this round (cut short by a weight update, or with groups still running) finished
    too few; partial groups wait in the pool and continue with the next round's weights. The
    batch's version is the engines' at the end (its tokens carry their own, token_weight_versions).
    `pool` (new_pool's, possibly restored from a checkpoint) holds the groups between rounds."""
    cfg, source = run.cfg, run.source
    pool = pool or new_pool(cfg, manager)

    def produce(step: int, version: int) -> RolloutBatch | None:
        wanted = cfg.rollout.num_prompts_per_step
        new = pool.prompts_wanted(wanted)
        pool.round(source.next_batch(new) if new else [], version, seed=cfg.seed * 100_003 + pool.rounds * 97)
        samples = pool.take(wanted)
        if samples is None:
            return None
        return RolloutBatch(samples, rollout_metrics(cfg, samples) | pool.metrics(samples), version,
                            source.state_dict())

    return timed(produce)


def new_pool(cfg: RunConfig, manager: RolloutManager, restored: PoolRecord | None = None) -> PartialPool:
    pool = PartialPool(manager, cfg.rollout.num_samples_per_prompt, cfg.rollout.partial.max_staleness_versions)
    if restored is not None:
        pool.restore(restored)
    return pool


def _schedule(run: TrainingRun, manager: RolloutManager, state: LoopState):
    """The schedule, and with rollout.partial its producer's pool (restored with its unconsumed
    batches when the checkpoint resumed from has them)."""
    cfg = run.cfg
    if not cfg.rollout.partial.enabled:
        return SCHEDULES[cfg.rollout.loop.kind](make_producer(run, manager), cfg), None
    pool = new_pool(cfg, manager, state.partial_pool)  # validated: fully_async
    schedule = SCHEDULES["fully_async"](make_partial_producer(run, manager, pool), cfg, engines=run.engines)
    if state.partial_pool is not None:
        schedule.restore([record_batch(b) for b in state.partial_pool.batches])
    return schedule, pool


def producer_state(run: TrainingRun, schedule, pool: PartialPool | None) -> tuple[dict | None, dict | None]:
    """rollout.partial, inside hold_engines (no round runs, the cut one has returned): the prompt
    cursor now and the pool with the batches made and not yet trained, which a checkpoint stores
    together so that a resume continues them. (None, None) without partial rollouts: a
    checkpoint then stores its batch's cursor, and a resume makes the later batches again."""
    if pool is None:
        return None, None
    return run.source.state_dict(), pool.state_dict(schedule.unconsumed())


def run_loop(run: TrainingRun, state: LoopState) -> LoopState:
    """Train from state to training.num_steps: one rollout batch, one update and one weight push
    per step, a checkpoint every checkpoint.interval_steps."""
    cfg, engines, evaluator = run.cfg, run.engines, run.evaluator
    manager = RolloutManager(engines, cfg.rollout, cfg.rollout.reward, return_routed_experts=cfg.routing_replay,
                             tokenizer=run.tokenizer)

    def record_evals(wait: bool) -> None:
        for step, metrics in evaluator.collect(wait).items():
            state.periodic_eval.append({"step": step, **metrics})
            run.hooks.on_metrics(step, metrics)

    schedule, pool = _schedule(run, manager, state)
    sharing = time_sharing(cfg, run.trainer, engines)  # placement.time_sharing: see miles_core.driver.time_sharing
    try:
        sharing.start()
        while state.step < cfg.training.num_steps:
            started = time.perf_counter()
            batch = schedule.next(state.step, state.weight_version)
            waited = time.perf_counter() - started
            metrics = batch.metrics | sharing.before_train()
            metrics |= train_on(cfg, run.trainer, batch)
            state.step += 1
            state.weight_version += 1
            checkpoint_due = state.step % cfg.checkpoint.interval_steps == 0 or state.step == cfg.training.num_steps
            with schedule.hold_engines():  # no generation runs while weights change
                if not sharing.enabled:  # time-sharing heals before it releases the engines
                    metrics["rollout/engine_restarts"] = float(len(engines.heal()))
                metrics |= sharing.push(lambda: run.push_weights(state.weight_version))
                if evaluator.due(state.step):  # rollout engines are held: rollout pauses
                    evaluator.run(state.step, state.weight_version, engines)
                cursor, partial = producer_state(run, schedule, pool) if checkpoint_due else (None, None)
            metrics |= throughput(batch, metrics[TRAIN_SECONDS]) | tokens_wasted(metrics)
            metrics |= {"time/rollout_seconds": batch.seconds, "time/rollout_wait_seconds": waited,
                        STEP_SECONDS: time.perf_counter() - started,
                        "rollout/weight_version": float(batch.version)}
            state.history.append({"step": state.step, **metrics})
            run.hooks.on_metrics(state.step, metrics)
            record_evals(wait=checkpoint_due)  # an eval becomes durable with the checkpoint after its step
            if checkpoint_due:
                run.hooks.before_checkpoint(state.step)
                run.save(state, batch.cursor if cursor is None else cursor, partial)
                run.hooks.on_checkpoint(state.step)
            run.hooks.on_step(state)
    finally:
        schedule.close()
    if state.history and (unused := unused_at_end(schedule, pool)):  # reached num_steps, producer stopped
        state.history[-1] |= unused
        run.hooks.on_metrics(state.step, unused)
    return state
