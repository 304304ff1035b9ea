"""The train side of a GRPO step alone, ours against TRL's, on the same micro-batches: where the
time goes (issue 39: our update was slower than TRL's pure-bf16 one).

    python bench/train_profile.py --device cuda --model qwen3-0.6b-shape --rows 256 --response-len 256 \
        --micro-batch 32 --trl-precision bf16 --profile-out /tmp/train-profile
    python bench/train_profile.py --device cpu --model tiny --rows 16 --response-len 16 --micro-batch 8   # smoke

One optimizer step = --rows sampled rows (random prompt and response tokens of the given
lengths, rewards +-1 in groups of --group), accumulated over micro-batches of --micro-batch rows:
- ours: FSDPTrainer.train_step as `miles run` trains (fp32 master weights and AdamW, bf16
  compute on a GPU, the fused log-prob pass, old log-probs from the update's own forward);
- TRL: GRPOTrainer.compute_loss + backward per micro-batch, then clip and AdamW, as its
  training_step runs them after generation (loss_type dapo, beta 0, one iteration), with the
  model in --trl-precision: fp32_autocast (fp32 weights, bf16 autocast; TRL's default with
  bf16=True) or bf16 (weights loaded in bf16: pure-bf16 training, TRL's fastest).
Each side runs --skip + --steps steps; the median of the last --steps is reported. With
--profile-out, one more step of each runs under torch.profiler: the top ops by self device
(or CPU) time go into the JSON and a Chrome trace per side into the folder. The last stdout
line is the JSON; it records the GPU and the torch, transformers and trl versions.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--model", choices=["tiny", "qwen3-0.6b-shape"], default="tiny")
    p.add_argument("--rows", type=int, default=16, help="P*G rows of one optimizer step")
    p.add_argument("--group", type=int, default=8, help="G: rows per prompt (advantages are per group)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--response-len", type=int, default=16)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--trl-precision", choices=["fp32_autocast", "bf16"], default="bf16")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--skip", type=int, default=1)
    p.add_argument("--profile-out", type=Path, default=None)
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/miles-train-profile"))
    args = p.parse_args(argv)
    if args.rows % args.micro_batch or args.rows % args.group:
        p.error("--micro-batch and --group must divide --rows")
    return args


def rows(args, vocab: int) -> list[tuple[list[int], list[int], float]]:
    """(prompt ids, response ids, reward) per row: one prompt per group, fixed lengths."""
    rng = random.Random(0)
    out = []
    for _ in range(args.rows // args.group):
        prompt = [rng.randrange(10, vocab) for _ in range(args.prompt_len)]
        for g in range(args.group):
            out.append((prompt, [rng.randrange(10, vocab) for _ in range(args.response_len)], 1.0 if g % 2 else -1.0))
    return out


def recipe(args):
    bf16 = ["model.dtype=bfloat16", "training.fsdp.compute_dtype=bfloat16"] if args.device == "cuda" else []
    return c.local_config([*bf16, f"training.micro_batch_size={args.micro_batch}",
                           f"rollout.num_samples_per_prompt={args.group}",
                           f"rollout.num_prompts_per_step={args.rows // args.group}",
                           f"rollout.max_new_tokens={args.response_len}", "training.lr=1e-6"])


class Ours:
    def __init__(self, args, cfg, model_dir: Path, data):
        from miles_core.training.fsdp import FSDPTrainer
        from miles_core.types import Sample

        self.device, r = args.device, cfg.rollout
        with c.trainer_device(args.device):
            self.trainer = FSDPTrainer(str(model_dir), cfg.training, cfg.algorithm, r.temperature, r.max_new_tokens,
                                       cfg.seed, r.num_samples_per_prompt)
        self.samples = [Sample(i // args.group, p, resp, str(reward), reward=reward,
                               rollout_logprobs=[-1.0] * len(resp)) for i, (p, resp, reward) in enumerate(data)]

    def step(self) -> None:
        with c.trainer_device(self.device):
            self.trainer.train_step(self.samples)


class Trl:
    def __init__(self, args, cfg, model_dir: Path, data):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from trl import GRPOTrainer

        gpu = args.device == "cuda"
        dtype = torch.bfloat16 if gpu and args.trl_precision == "bf16" else torch.float32
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        config = c.trl_grpo_config(cfg, args.work_dir / "trl", 1, bf16=gpu, cpu=not gpu)
        self.trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **_: [0.0] * len(completions),
                                   args=config, train_dataset=c.hf_dataset([{"prompt": "x"}]),
                                   processing_class=AutoTokenizer.from_pretrained(model_dir))
        self.trainer.create_optimizer_and_scheduler(num_training_steps=1_000)
        self.trainer.model.train()
        self.accumulation = args.rows // args.micro_batch
        self.trainer.current_gradient_accumulation_steps = self.accumulation
        self.micro_batches = [self._inputs(data[i:i + args.micro_batch], sum(len(r) for _, r, _ in data))
                              for i in range(0, len(data), args.micro_batch)]

    def _inputs(self, part, num_items: int) -> dict:
        import torch

        device = self.trainer.accelerator.device
        ids = lambda key: torch.tensor([row[key] for row in part], device=device)  # noqa: E731
        rewards = torch.tensor([row[2] for row in part], device=device)
        return {"prompt_ids": ids(0), "prompt_mask": torch.ones_like(ids(0)), "completion_ids": ids(1),
                "completion_mask": torch.ones_like(ids(1)), "advantages": rewards,
                "num_items_in_batch": torch.tensor(float(num_items), device=device)}

    def step(self) -> None:
        t = self.trainer
        for inputs in self.micro_batches:
            with t.compute_loss_context_manager():
                loss = t.compute_loss(t.model, inputs)
            t.accelerator.backward(loss)
        t.accelerator.clip_grad_norm_(t.model.parameters(), t.args.max_grad_norm)
        t.optimizer.step()
        t.optimizer.zero_grad(set_to_none=True)


def timed(side, args) -> list[float]:
    import torch

    seconds = []
    for _ in range(args.skip + args.steps):
        started = time.perf_counter()
        side.step()
        if args.device == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - started)
    return seconds[args.skip:]


def profiled(side, name: str, args) -> list[dict]:
    """Top ops of one more step by self time on the device (CPU when there is none)."""
    from torch.profiler import ProfilerActivity, profile

    gpu = args.device == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if gpu else [])]
    with profile(activities=activities) as prof:
        side.step()
    args.profile_out.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(args.profile_out / f"{name}.json"))
    key = "self_device_time_total" if gpu else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, key), reverse=True)[:15]
    return [{"op": e.key, "ms": getattr(e, key) / 1000, "calls": e.count} for e in events]


def main(argv=None) -> dict:
    args = parse_args(argv)
    c.setup_env()
    c.stub_ray_if_missing()
    import trl
    from transformers import AutoConfig

    model_dir = c.prepare_model(args.model, args.work_dir)
    cfg, data = recipe(args), None
    data = rows(args, AutoConfig.from_pretrained(model_dir).vocab_size)
    result = {"bench": "train_profile", **c.gpu_identity(), "trl": trl.__version__, "model": args.model,
              "rows": args.rows, "micro_batch": args.micro_batch, "prompt_len": args.prompt_len,
              "response_len": args.response_len, "trl_precision": args.trl_precision}
    for name, build in (("ours", Ours), ("trl", Trl)):
        with contextlib.redirect_stdout(sys.stderr):
            side = build(args, cfg, model_dir, data)
            seconds = timed(side, args)
            result[name] = {"step_seconds": seconds, "step_seconds_median": c.median(seconds)}
            if args.profile_out:
                result[name]["top_ops"] = profiled(side, name, args)
        c.log(f"{name}: {result[name]['step_seconds_median']:.3f} s per optimizer step")
        del side
    result["ratio_ours_over_trl"] = result["ours"]["step_seconds_median"] / result["trl"]["step_seconds_median"]
    print(json.dumps(c.rounded(result)), flush=True)
    return result


if __name__ == "__main__":
    main()
