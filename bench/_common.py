"""Shared helpers of the benchmarks: models, data, SFT warm-up, configs, timing, logging.

Everything here runs without Ray (the lent GPU machine has none): `stub_ray_if_missing`
lets miles_core's modules import there, and the warm-up runs the trainer in-process.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import sys
import time
import types
from collections.abc import Iterable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
LOCAL_RECIPE = REPO / "configs" / "local.yaml"

# The 0.6B shape of the GRPO comparison (random weights, the project's char tokenizer).
QWEN3_06B_SHAPE = {"hidden_size": 1024, "num_hidden_layers": 28, "num_attention_heads": 16,
                   "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 3072,
                   "vocab_size": 151936, "tie_word_embeddings": True}
# Qwen3-4B's shape (its config.json), random weights: the time-sharing recipe's model.
QWEN3_4B_SHAPE = {"hidden_size": 2560, "num_hidden_layers": 36, "num_attention_heads": 32,
                  "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 9728,
                  "vocab_size": 151936, "tie_word_embeddings": True}
SHAPES = {"qwen3-0.6b-shape": QWEN3_06B_SHAPE, "qwen3-4b-shape": QWEN3_4B_SHAPE}


def setup_env() -> None:
    """Quiet, deterministic library settings (as in tests/conftest.py); repo importable."""
    for key, value in {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
                       "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error",
                       "TOKENIZERS_PARALLELISM": "false", "TQDM_DISABLE": "1",
                       "PYTHONWARNINGS": "ignore"}.items():
        os.environ.setdefault(key, value)
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    import warnings

    warnings.filterwarnings("ignore")


def stub_ray_if_missing() -> bool:
    """miles_core.weight_sync.transports imports ray at module level; the in-process paths never call it.
    Returns True when a stub was installed (no Ray on this machine)."""
    try:
        import ray  # noqa: F401
        return False
    except ImportError:
        sys.modules["ray"] = types.ModuleType("ray")
        return True


def start_gpu_bench(script: str, out_dir: Path | None = None) -> float:
    """A single-GPU bench's start: quiet libraries, Ray stubbed where absent, the --out folder
    made; where CUDA is absent, exit with one line (a GPU bench measures nothing on CPU).
    Returns the start time (time.perf_counter) its time budget counts from."""
    setup_env()
    stub_ray_if_missing()
    began = time.perf_counter()
    import torch

    if not torch.cuda.is_available():
        raise SystemExit(f"bench/{Path(script).name} needs a GPU")
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
    return began


def gpu_identity() -> dict[str, str]:
    """What a GPU figure was measured on: the GPU's name and the library versions."""
    import torch
    import transformers

    return {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
            "torch": torch.__version__, "transformers": transformers.__version__}


def kv_cache_shape(engine) -> str:
    """slots x columns of an EmbeddedEngine's slot cache (fewer slots than sequences: it decodes in rounds)."""
    cache = engine.slots.cache if engine.slots is not None else None
    return "none" if cache is None else "{} slots x {} columns".format(*cache.layers[0].keys.shape[::2])


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def median(values: Iterable[float]) -> float | None:
    values = list(values)
    return statistics.median(values) if values else None


def rounded(tree: Any, digits: int = 4) -> Any:
    if isinstance(tree, float):
        return round(tree, digits)
    if isinstance(tree, dict):
        return {k: rounded(v, digits) for k, v in tree.items()}
    if isinstance(tree, list):
        return [rounded(v, digits) for v in tree]
    return tree


def local_config(overrides: list[str]):
    """configs/local.yaml plus dotted overrides, validated (miles_core.config.build_config)."""
    import yaml

    from miles_core.config import build_config

    return build_config(yaml.safe_load(LOCAL_RECIPE.read_text()), overrides)


def _digest(payload: dict) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:12]


def prepare_data(work_dir: Path) -> Path:
    from miles_core.data import write_arithmetic_task

    cfg = local_config([])
    train, _ = write_arithmetic_task(cfg.data.builtin, work_dir / f"data-{_digest(cfg.data.builtin.model_dump())}")
    return train


def _build_qwen3_shape(shape: dict, out_dir: Path) -> Path:
    from transformers import Qwen3Config

    from miles_core.tiny import build_tokenizer, save_random_model

    tokenizer = build_tokenizer()
    assert len(tokenizer) <= shape["vocab_size"]  # every token id is a valid embedding row
    config = Qwen3Config(**shape, max_position_embeddings=40960, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None, torch_dtype="float32")
    return save_random_model(config, tokenizer, out_dir, seed=0)


def prepare_model(kind: str, work_dir: Path) -> Path:
    """`tiny`: the built-in tiny Qwen3; `qwen3-0.6b-shape` / `qwen3-4b-shape`: a random Qwen3 of
    that shape. Built once per work_dir (random weights are seeded, so a rebuild is identical)."""
    from miles_core.config import TinyModelConfig
    from miles_core.tiny import build_tiny_model

    out = work_dir / f"model-{kind}"
    if (out / "config.json").is_file():
        return out
    log(f"building model {kind} in {out}")
    if kind == "tiny":
        return build_tiny_model(TinyModelConfig(), out)
    if kind in SHAPES:
        return _build_qwen3_shape(SHAPES[kind], out)
    raise ValueError(f"unknown model {kind!r}")


def trainer_device(device: str):
    """Context in which miles_core's FSDPTrainer is built and stepped on `device`.

    FSDPTrainer creates tensors without a device argument (they follow torch's default device)
    and, outside a launcher, makes a private world-size-1 gloo group. On CUDA a world-size-1
    NCCL group is made first (FSDP2's collectives then run on the GPU) and the default device
    is CUDA inside the context. On CPU nothing changes.
    """
    import contextlib

    import torch

    if device == "cpu":
        return contextlib.nullcontext()
    import torch.distributed as dist

    if not dist.is_initialized():
        from miles_core.net import free_port

        port = free_port()
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                                device_id=torch.device("cuda", 0))
    return torch.device(device)


def sft_warmup(model_dir: Path, train_path: Path, steps: int, work_dir: Path, device: str) -> Path:
    """What miles_core.warmup.run_sft_warmup does (local recipe's batch size and lr), but
    in-process so no Ray is needed. Cached by model, steps and device; 0 steps = random model."""
    if steps == 0:
        return model_dir
    import random

    from transformers import AutoTokenizer

    from miles_core.data import read_prompts, sft_samples
    from miles_core.training.fsdp import FSDPTrainer

    cfg = local_config([f"warmup.sft_steps={steps}"])
    key = _digest({"model": model_dir.name, "warmup": cfg.warmup.model_dump(), "seed": cfg.seed, "device": device})
    out = work_dir / f"warm-{model_dir.name}-{key}"
    if (out / "model.safetensors").is_file():
        log(f"SFT warm-up cached at {out}")
        return out
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    samples = sft_samples(read_prompts(train_path, cfg.data, tokenizer), tokenizer)
    training = cfg.training.model_copy(update={"lr": cfg.warmup.lr, "lr_warmup_steps": 0})
    rng, started = random.Random(cfg.seed), time.perf_counter()
    with trainer_device(device):
        trainer = FSDPTrainer(str(model_dir), training, cfg.algorithm, seed=cfg.seed)
        for _ in range(steps):
            loss = trainer.sft_step(rng.sample(samples, min(cfg.warmup.batch_size, len(samples))))
        trainer.export_hf(str(out) + ".tmp")
    trainer.close()
    os.replace(str(out) + ".tmp", out)
    log(f"SFT warm-up: {steps} steps in {time.perf_counter() - started:.1f} s, last loss {loss:.3f} -> {out}")
    return out


def copy_floor_seconds(model_dir: Path, engine_dtype: str) -> float:
    """One `torch._foreach_copy_` of the model's weights (float32, as the trainer holds them) into
    tensors of the engine's dtype, on the device the run used: the floor a sync is measured against."""
    import torch
    from safetensors.torch import load_file

    device = "cuda" if torch.cuda.is_available() else "cpu"
    return foreach_copy_seconds([t.to(device, torch.float32) for t in load_file(str(model_dir / "model.safetensors")).values()],
                                engine_dtype)


def foreach_copy_seconds(source: list, engine_dtype: str) -> float:
    """Median time of one `torch._foreach_copy_` of `source` into new tensors of engine_dtype on
    the same device (10 copies, the first two not counted)."""
    import torch

    target = [torch.empty_like(t, dtype=getattr(torch, engine_dtype)) for t in source]
    cuda = source[0].is_cuda
    seconds = []
    for _ in range(10):
        if cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        torch._foreach_copy_(target, source)
        if cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - started)
    return median(seconds[2:])


def colocated_overrides(gpu: bool, transport: str) -> list[str]:
    """One trainer and one embedded engine sharing the machine (on a GPU: fractional bundles of
    one GPU, bf16 engine), exactly as `miles run` places a colocated run."""
    return [f"training.gpus_per_trainer={0.5 if gpu else 0}", "training.cpus_per_trainer=4", "training.num_threads=4",
            f"rollout.gpus_per_engine={0.4 if gpu else 0}", "rollout.cpus_per_engine=4",
            f"model.dtype={'bfloat16' if gpu else 'float32'}", f"rollout.weight_transport={transport}",
            "placement.layout=colocated"]


def hf_dataset(rows: list[dict]):
    """A `datasets.Dataset` of `rows` with a fingerprint from their content. datasets would hash
    the Arrow table with dill, which pickles pyarrow by value, and fails, where pyarrow lies
    outside a site-packages folder (the GPU machine's PYTHONPATH=/tmp/site)."""
    import pyarrow as pa
    from datasets import Dataset

    return Dataset(pa.Table.from_pylist(rows), fingerprint=hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16])


# algorithm.loss_aggregation -> TRL's loss_type of the same reduction: "dapo" normalises by the
# batch's tokens (token_mean), "grpo" averages per sequence, "dr_grpo" by a constant length.
TRL_LOSS_TYPES = {"token_mean": "dapo", "seq_mean_token_mean": "grpo", "seq_mean_token_sum_norm": "dr_grpo"}


def trl_grpo_config(cfg, out_dir: Path, max_steps: int, *, bf16: bool, cpu: bool, gradient_checkpointing: bool = False,
                    **extra):
    """TRL's GRPOConfig (no vLLM) matching recipe `cfg`: one generation of P*G completions per
    optimizer step, accumulated over micro-batches of training.micro_batch_size, the recipe's lr,
    lengths, sampling, clip range, KL weight, advantage scaling, loss reduction and optimizer."""
    from trl import GRPOConfig

    a, t, r = cfg.algorithm, cfg.training, cfg.rollout
    rows = r.num_prompts_per_step * r.num_samples_per_prompt
    micro = min(t.micro_batch_size, rows)  # ours too trains a smaller batch in one micro-batch
    if rows % micro:
        raise SystemExit(f"training.micro_batch_size {micro} must divide P*G = {rows}")
    return GRPOConfig(
        output_dir=str(out_dir), max_steps=max_steps, per_device_train_batch_size=micro,
        gradient_accumulation_steps=rows // micro, generation_batch_size=rows,
        num_generations=r.num_samples_per_prompt, max_completion_length=r.max_new_tokens,
        temperature=r.temperature, top_p=r.top_p, learning_rate=t.lr,
        lr_scheduler_type="constant_with_warmup" if t.lr_warmup_steps else "constant", warmup_steps=t.lr_warmup_steps,
        optim="adamw_torch", adam_beta1=t.adam_betas[0], adam_beta2=t.adam_betas[1],
        weight_decay=t.weight_decay, max_grad_norm=t.grad_clip, epsilon=a.eps_clip_low, epsilon_high=a.eps_clip_high,
        beta=a.kl_loss_coef, loss_type=TRL_LOSS_TYPES[a.loss_aggregation],
        scale_rewards="group" if a.normalize_std else "none", use_vllm=False, report_to=[], logging_steps=1,
        save_strategy="no", bf16=bf16, fp16=False, use_cpu=cpu, seed=cfg.seed,
        gradient_checkpointing=gradient_checkpointing, disable_tqdm=True, dataloader_pin_memory=False, **extra)
