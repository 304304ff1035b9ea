"""Evaluation during training, every `eval.interval_steps` RL steps.

Three places to generate, chosen by config:
- the rollout engines (eval.periodic_engines=rollout): the schedule holds its producer while
  eval runs, so rollout pauses and the engines score exactly the weights just pushed;
- dedicated engines (eval.periodic_engines=dedicated): extra engine actors get the step's
  weights and evaluate in a background thread while rollout and training go on; the result
  is collected before the next checkpoint, so it becomes durable together with its step;
- an external command (eval.mode=external_command): the step's weights are exported as an
  HF directory and handed to the command.

Results come back as MLflow-ready metrics at the step whose weights they scored:
`eval/periodic/<dataset>/pass_at_k`.
"""

from __future__ import annotations

import logging
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import ray

from miles_core.config import RunConfig
from miles_core.config.rollout import DiskTransportConfig, ObjectStoreTransportConfig
from miles_core.evaluation import core as evaluation
from miles_core.evaluation.core import EngineGroupEval, eval_metrics
from miles_core.metrics import PERIODIC, PERIODIC_EVAL_SECONDS
from miles_core.rollout.engine_group import EngineGroup
from miles_core.weight_sync.transports import make_transport

log = logging.getLogger(__name__)
PHASE = PERIODIC


class PeriodicEvaluator:
    """`due(step)` says whether to evaluate; `run(step, ...)` evaluates the current policy (or
    starts to, on dedicated engines); `collect()` returns {step: metrics} of finished evals."""

    def __init__(self, cfg: RunConfig, model_dir: str, eval_path: str | None, trainer: Any, run_dir: Path,
                 tokenizer: Any):
        self.cfg, self.eval_path, self.trainer, self.run_dir = cfg, eval_path, trainer, run_dir
        self.tokenizer = tokenizer
        self.interval = cfg.eval.interval_steps if eval_path else 0
        self.dedicated: EngineGroup | None = None
        self.pending: dict[int, Future] = {}
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="periodic-eval")
        if self.interval and cfg.eval.mode == "local_engine" and cfg.eval.periodic_engines == "dedicated":
            eval_cfg = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(
                update={"num_engines": cfg.eval.num_dedicated_engines})})
            self.dedicated = EngineGroup(eval_cfg, model_dir)
            # Not a broadcast: a second group to other engines would rebuild the rollout group's
            # communicator at every eval. SGLang takes no tensors in-process, so it loads from disk.
            kind = DiskTransportConfig() if cfg.rollout.engine.kind == "sglang" else ObjectStoreTransportConfig()
            self.transport = make_transport(kind, run_dir / "eval_weight_sync", cfg.rollout.verify_weight_sync,
                                            api_key=self.dedicated.api_key)

    def due(self, step: int) -> bool:
        return bool(self.interval) and step % self.interval == 0

    def run_on_rollout_engines(self, step: int, engines: EngineGroup) -> None:
        """Call with rollout held and the step's weights on the engines: evaluates now."""
        self.pending[step] = _done(self._evaluate(engines, step))

    def run(self, step: int, version: int, engines: EngineGroup) -> None:
        """Evaluate the policy after `step` (its weights are `version`) where configured."""
        if self.cfg.eval.mode == "external_command":
            self.pending[step] = _done(self._external(step))
        elif self.dedicated is None:
            self.run_on_rollout_engines(step, engines)
        else:
            self.dedicated.heal()
            self.transport.push(self.trainer, self.dedicated.targets(), version)
            self.pending[step] = self.pool.submit(self._evaluate, self.dedicated, step)

    def collect(self, wait: bool = False) -> dict[int, dict[str, float]]:
        """Metrics of every finished eval (all of them with wait=True), oldest step first."""
        ready = {}
        for step in sorted(self.pending):
            if wait or self.pending[step].done():
                ready[step] = self.pending.pop(step).result()
        return ready

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        if self.dedicated is not None:
            self.dedicated.shutdown()

    def _evaluate(self, engines: EngineGroup, step: int) -> dict[str, float]:
        started = time.perf_counter()
        client = EngineGroupEval(engines, self.tokenizer)
        try:
            results = evaluation.evaluate_all(self.cfg, None, self.eval_path, engine=client)
        finally:
            client.close()
        metrics = eval_metrics(PHASE, results)
        log.info("periodic eval at step %d: %s", step,
                 ", ".join(f"{k.split('/', 2)[2]} {v:.3f}" for k, v in metrics.items()))
        # on the rollout engines it holds training: time-to-accuracy figures subtract it
        return {**metrics, PERIODIC_EVAL_SECONDS: time.perf_counter() - started}

    def _external(self, step: int) -> dict[str, float]:
        with tempfile.TemporaryDirectory(prefix=f"miles-eval-step{step}-", dir=self.run_dir) as tmp:
            ray.get(self.trainer.export_hf.remote(str(Path(tmp) / "hf")))
            results = evaluation.evaluate_all(self.cfg, Path(tmp) / "hf", self.eval_path)
        return eval_metrics(PHASE, results)


def _done(value: Any) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future
