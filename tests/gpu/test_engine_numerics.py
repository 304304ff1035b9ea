"""The embedded engine's log-probs against the trainer's, on a lent GPU (not run in CI).

The engine runs as `miles run` runs it on CUDA: bf16 weights, slot decoding (continuous batching
over a preallocated KV cache) and compiled decode steps replayed as CUDA graphs. It samples at
temperature 1 from a random Qwen3 (4 layers, hidden 512, Qwen3's 151,936-token vocabulary); the
FSDP2 trainer then scores the same tokens as it scores old log-probs (RLTrainerCore.compute_logprobs:
fp32 master weights, bf16 compute through FSDP2's MixedPrecisionPolicy, the fused log-prob pass
of miles_core/training/logprobs.py). The mean absolute difference per token must stay under
MEAN_BOUND; the same engine with one decoder layer's weights scaled by PERTURB_SCALE must exceed it
(the bound is shown to catch a small error on one side). The test also asserts the engine took the
slot path with CUDA graphs (captured and replayed, none skipped), not transformers' generate or
eager steps, and prints the numbers (run with -s):

    PYTHONPATH=/tmp/site python -m pytest tests/gpu/test_engine_numerics.py -s -q   # 43 s on an H100

(/tmp/site: pydantic and pytest, from tests/gpu/carry.py's `tools` set via tests/gpu/install.sh.)

`measure()` is the whole comparison as one function; on a CPU it runs with device="cpu" and
graphs=False (slot decoding, eager steps), e.g. on a small model by hand. Ray is stubbed when
missing (the GPU machine has none); nothing here calls it.
"""

from __future__ import annotations

import sys
import time
import types
import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
try:
    import ray  # noqa: F401
except ImportError:  # miles_core.weight_sync.transports imports ray at module level; nothing here calls it
    sys.modules["ray"] = types.ModuleType("ray")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]

SHAPE = {"hidden_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
         "head_dim": 64, "intermediate_size": 1536, "vocab_size": 151936}
MAX_POSITIONS = 1024
PROMPTS, MAX_NEW_TOKENS, SEED = 64, 256, 7
MEAN_BOUND = 0.02
"""Mean |engine - trainer| per token, nats. Measured on an H100 (torch 2.11, transformers 5.17;
64 x 256 = 16,384 tokens): 0.0037 (max 0.023) against the bf16-compute trainer, 0.0040 (max 0.024)
against the fp32 one; with layer 1 scaled in the engine by 1.01: 0.0077, by 1.02: 0.014, by 1.05:
0.034. So the bound catches a 5% error in one layer's weights, not a 1% one (that is within about
2x of bf16's own rounding here). A CPU run of measure() (eager bf16 slot steps) gives about the same."""
PERTURB_LAYER, PERTURB_SCALE = 1, 1.05
"""The negative case: every matrix of decoder layer PERTURB_LAYER scaled by PERTURB_SCALE in the
engine only."""
INFO_SCALES = (1.01, 1.02)
"""Further perturbations measured and printed, not asserted."""


def build_model(out_dir: Path, shape: dict = SHAPE, max_positions: int = MAX_POSITIONS, seed: int = 0) -> Path:
    """A random Qwen3 of `shape` with the project's character tokenizer (miles_core.tiny), saved
    as an HF directory in fp32 (the trainer's master dtype; the engine loads it as bf16)."""
    from transformers import Qwen3Config

    from miles_core.tiny import build_tokenizer, save_random_model

    tokenizer = build_tokenizer()
    assert len(tokenizer) <= shape["vocab_size"]
    config = Qwen3Config(**shape, max_position_embeddings=max_positions, tie_word_embeddings=True,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
                         torch_dtype="float32")
    return save_random_model(config, tokenizer, out_dir, seed)


def random_prompts(num: int, vocab_size: int, seed: int = 0, lengths: tuple[int, int] = (8, 64)) -> list[list[int]]:
    """Prompts of random ids (past the tokenizer's 5 special tokens) and random lengths."""
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(lengths[0], lengths[1] + 1, (num,), generator=g).tolist()
    return [torch.randint(5, vocab_size, (n,), generator=g).tolist() for n in sizes]


class DecodePath:
    """What the slot decoder ran while active: decode steps (slot_decoder._Run._step), CUDA
    graphs captured and replayed (torch.cuda.CUDAGraph, which cudagraph trees record into and
    replay from), and Inductor's skipped-cudagraph and Dynamo's graph-break counters. Patches
    classes, not the instance: the decoder steps on its own thread."""

    def __enter__(self) -> DecodePath:
        from torch._dynamo.utils import counters

        from miles_core.engines.embedded import slot_decoder

        self.counters, self.run_cls = counters, slot_decoder._Run
        self.steps = self.captures = self.replays = 0
        self.skips0 = counters["inductor"]["cudagraph_skips"]
        self.breaks0 = sum(counters["graph_break"].values())
        self.originals = {"step": self.run_cls._step}
        step = self.run_cls._step

        def counted_step(run):
            self.steps += 1
            return step(run)

        self.run_cls._step = counted_step
        if torch.cuda.is_available():
            graph = torch.cuda.CUDAGraph
            self.originals |= {"capture_begin": graph.capture_begin, "replay": graph.replay}
            capture_begin, replay = graph.capture_begin, graph.replay

            def counted_capture(g, *args, **kwargs):
                self.captures += 1
                return capture_begin(g, *args, **kwargs)

            def counted_replay(g, *args, **kwargs):
                self.replays += 1
                return replay(g, *args, **kwargs)

            graph.capture_begin, graph.replay = counted_capture, counted_replay
        return self

    def __exit__(self, *exc) -> None:
        self.run_cls._step = self.originals["step"]
        if "replay" in self.originals:
            torch.cuda.CUDAGraph.capture_begin = self.originals["capture_begin"]
            torch.cuda.CUDAGraph.replay = self.originals["replay"]
        self.cudagraph_skips = self.counters["inductor"]["cudagraph_skips"] - self.skips0
        self.graph_breaks = sum(self.counters["graph_break"].values()) - self.breaks0

    def summary(self) -> dict:
        return {"decode_steps": self.steps, "cuda_graph_captures": self.captures, "cuda_graph_replays": self.replays,
                "cudagraph_skips": self.cudagraph_skips, "graph_breaks": self.graph_breaks}


def build_engine(model_dir: Path, device: str, graphs: bool, max_batch_size: int):
    """The engine as an engine service builds it (EmbeddedEngine's defaults: on CUDA, slot
    decoding with compiled steps); graphs=False swaps in eager slot steps (the CPU's path)."""
    from miles_core.engines.embedded.engine import EmbeddedEngine
    from miles_core.engines.embedded.slot_decoder import SlotDecoder

    engine = EmbeddedEngine(str(model_dir), dtype="bfloat16", device=device, max_batch_size=max_batch_size,
                            slot_decoding=None if device.startswith("cuda") else True)
    if not graphs and engine.slots is not None and engine.slots.compiled:
        engine.slots = SlotDecoder(engine.model, engine.pad_id, max_batch_size, compile_steps=False)
    return engine


def rollout(engine, prompts: list[list[int]], max_new_tokens: int, seed: int) -> list:
    """Temperature-1 samples as Samples carrying the engine's per-token log-probs."""
    from miles_core.types import Sample

    params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": max_new_tokens, "ignore_eos": True}
    outs = engine.generate(prompts, params, return_logprob=True, seed=seed)
    return [Sample(prompt_index=i, prompt_ids=p, response_ids=o["output_ids"], label="",
                   rollout_logprobs=[lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]])
            for i, (p, o) in enumerate(zip(prompts, outs))]


def build_trainer(model_dir: Path, compute_dtype: str, micro_batch_size: int):
    """FSDPTrainer as `miles run` builds it for a GPU recipe (training.fsdp.compute_dtype)."""
    from miles_core.config import AlgorithmConfig, TrainingConfig
    from miles_core.config.training import FSDPConfig
    from miles_core.training.fsdp import FSDPTrainer

    training = TrainingConfig(micro_batch_size=micro_batch_size, fsdp=FSDPConfig(compute_dtype=compute_dtype))
    return FSDPTrainer(str(model_dir), training, AlgorithmConfig(name="grpo"), temperature=1.0)


def gap(samples: list, trained: list[list[float]]) -> dict:
    """Mean, max and count of |engine - trainer| over every response token."""
    assert [len(s.rollout_logprobs) for s in samples] == [len(t) for t in trained]
    diffs = torch.tensor([abs(a - b) for s, t in zip(samples, trained) for a, b in zip(s.rollout_logprobs, t)],
                         dtype=torch.float64)
    return {"mean": float(diffs.mean()), "max": float(diffs.max()), "tokens": diffs.numel(),
            "engine_mean_logprob": sum(sum(s.rollout_logprobs) for s in samples) / diffs.numel()}


def score(model_dir: Path, compute_dtype: str, rollouts: dict[str, list], micro_batch_size: int) -> dict:
    """The trainer's log-prob pass over each set of rollouts, as a gap per set, plus what the
    trainer computed in: its parameters' dtype (master weights) and its logits' dtype."""
    from miles_core.training import logprobs

    trainer = build_trainer(model_dir, compute_dtype, micro_batch_size)
    logits_dtypes: set[torch.dtype] = set()
    hook = trainer.model.lm_head.register_forward_hook(lambda _m, _i, out: logits_dtypes.add(out.dtype))
    master = {p.dtype for group in trainer.optimizer.param_groups for p in group["params"]}  # what AdamW updates
    try:
        gaps = {name: gap(samples, trainer.compute_logprobs(samples)) for name, samples in rollouts.items()}
    finally:
        hook.remove()
        trainer.close()
    return {"gaps": gaps, "master_dtypes": sorted(str(d) for d in master),
            "logits_dtypes": sorted(str(d) for d in logits_dtypes),
            "compiled_logprobs_failed": "failed" in logprobs._COMPILED}


def perturbed(engine, layer: int, scale: float):
    """Context: every matrix of one decoder layer of the engine scaled by `scale` (in place, so
    the compiled steps' CUDA graphs read it), restored on exit."""
    import contextlib

    @contextlib.contextmanager
    def scaled():
        mats = [p for p in engine.model.model.layers[layer].parameters() if p.dim() == 2]
        saved = [p.detach().clone() for p in mats]
        with torch.no_grad():
            for p in mats:
                p.mul_(scale)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, s in zip(mats, saved):
                    p.copy_(s)

    return scaled()


def measure(model_dir: Path, device: str = "cuda", graphs: bool = True, num_prompts: int = PROMPTS,
            max_new_tokens: int = MAX_NEW_TOKENS, seed: int = SEED, perturb_layer: int = PERTURB_LAYER,
            perturb_scales: tuple[float, ...] = (PERTURB_SCALE, *INFO_SCALES), fp32_reference: bool = True) -> dict:
    """Engine rollouts (as built, then with one layer scaled by each of perturb_scales) scored by
    the trainer in bf16 compute (and fp32, for reference); the decode path the engine took; the
    warnings raised on the way (by category and message start)."""
    began = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = build_engine(model_dir, device, graphs, max_batch_size=max(num_prompts, 1))
        prompts = random_prompts(num_prompts, engine.model.config.vocab_size, seed)
        path = {"decode_path": engine.decode_path, "slots": engine.slots is not None,
                "compiled_steps": bool(engine.slots and engine.slots.compiled), "engine_dtype": str(engine.model.dtype)}
        with DecodePath() as decode:
            rollouts = {"engine": rollout(engine, prompts, max_new_tokens, seed)}
            for scale in perturb_scales:
                with perturbed(engine, perturb_layer, scale):
                    rollouts[f"layer{perturb_layer}x{scale:g}"] = rollout(engine, prompts, max_new_tokens, seed)
        path |= decode.summary()
        engine_s = time.perf_counter() - began
        del engine
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
        micro = max(num_prompts, 1)
        result = {"device": device, "path": path, "engine_s": engine_s,
                  "bf16": score(model_dir, "bfloat16", rollouts, micro)}
        if fp32_reference:
            result["fp32"] = score(model_dir, "float32", {"engine": rollouts["engine"]}, micro)
    result["warnings"] = dict(Counter(f"{w.category.__name__}: {str(w.message)[:120]}" for w in caught))
    result["wall_s"] = time.perf_counter() - began
    return result


def report(result: dict) -> str:
    lines = [f"engine path: {result['path']}"]
    for trainer in ("bf16", "fp32"):
        if trainer in result:
            t = result[trainer]
            lines.append(f"trainer {trainer} compute (master {t['master_dtypes']}, logits {t['logits_dtypes']}, "
                         f"compiled log-prob fallback {t['compiled_logprobs_failed']}):")
            lines += [f"    {name:>14}: mean {g['mean']:.5f} max {g['max']:.5f} over {g['tokens']} tokens "
                      f"(engine mean log-prob {g['engine_mean_logprob']:.3f})" for name, g in t["gaps"].items()]
    lines.append(f"warnings: {result['warnings'] or 'none'}; engine {result['engine_s']:.0f} s, "
                 f"all {result['wall_s']:.0f} s")
    return "\n".join(lines)


# ---- the GPU test ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict:
    sys.path.insert(0, str(REPO / "bench"))
    from _common import gpu_identity

    model_dir = build_model(tmp_path_factory.mktemp("numerics") / "model")
    result = measure(model_dir)
    print(f"\n{gpu_identity()}\n{report(result)}")
    return result


def test_engine_took_the_slot_path_with_cuda_graphs(measured):
    path = measured["path"]
    assert path["decode_path"] == "slots" and path["slots"] and path["compiled_steps"], path  # not generate, not eager
    assert path["engine_dtype"] == "torch.bfloat16"
    assert path["decode_steps"] >= MAX_NEW_TOKENS - 1, path  # a prompt's first token comes from its prefill
    assert path["cuda_graph_captures"] > 0 and path["cudagraph_skips"] == 0, path
    assert path["cuda_graph_replays"] >= path["decode_steps"] // 2, path  # steps replay recorded graphs


def test_trainer_computed_as_run(measured):
    bf16 = measured["bf16"]
    assert bf16["master_dtypes"] == ["torch.float32"] and bf16["logits_dtypes"] == ["torch.bfloat16"], bf16
    assert not bf16["compiled_logprobs_failed"]


def test_engine_logprobs_match_the_trainer(measured):
    tokens = PROMPTS * MAX_NEW_TOKENS
    for trainer in ("bf16", "fp32"):
        g = measured[trainer]["gaps"]["engine"]
        assert g["tokens"] == tokens
        assert g["mean"] < MEAN_BOUND, (trainer, g)


def test_one_scaled_layer_breaks_the_bound(measured):
    g = measured["bf16"]["gaps"][f"layer{PERTURB_LAYER}x{PERTURB_SCALE:g}"]
    assert g["mean"] > MEAN_BOUND, g
