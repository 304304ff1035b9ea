"""GRPO step time: this project vs TRL's GRPOTrainer, same model, batch, lengths and lr.

    python bench/grpo_vs_trl.py --device cpu --model tiny --mode inprocess --steps 6

Modes for "ours":
  inprocess  one sync step = EmbeddedEngine.generate (through RolloutManager, with rewards)
             + FSDPTrainer.train_step + weight copy into the engine, all in this process.
             Its steps are interleaved one-to-one with TRL's (ours runs between TRL steps,
             outside TRL's timed window), so both see the same machine load. Works without Ray.
  ray        miles_core.driver.session.run_training on a local Ray (trainer and engine actors, sync
             loop, object-store weight sync); ours and TRL alternate run by run (--repeats).

TRL: GRPOTrainer(use_vllm=False) with one generation of P*G completions per optimizer step
(generation_batch_size = P*G, per_device_train_batch_size = --micro-batch, accumulated); each optimizer
step is timed from on_step_begin to on_step_end. The first --skip steps of each are dropped.
Progress goes to stderr; the last stdout line is the JSON result.

One side per process (--side ours | trl): each side alone on the machine, for runs where both
do not fit one process's memory or one command's time (1024 tokens on one GPU). The first run
saves its side's result (--save FILE); the second, on the same machine with the same settings,
reads it (--compare FILE) and prints the JSON with the ratio:

    python bench/grpo_vs_trl.py --side trl --save /tmp/trl.json ...
    python bench/grpo_vs_trl.py --side ours --compare /tmp/trl.json ...
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--model", choices=["tiny", "qwen3-0.6b-shape"], default="tiny")
    p.add_argument("--mode", choices=["inprocess", "ray"], default="inprocess", help="how ours is run")
    p.add_argument("--steps", type=int, default=6, help="timed steps of each (after --skip warm-up steps)")
    p.add_argument("--skip", type=int, default=2, help="warm-up steps dropped from each")
    p.add_argument("--repeats", type=int, default=1, help="ray mode: ours/TRL runs, alternating")
    p.add_argument("--prompts", type=int, default=32, help="P: prompts per step")
    p.add_argument("--samples", type=int, default=8, help="G: samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=6, help="L: max generation length")
    p.add_argument("--micro-batch", type=int, default=None,
                   help="rows per forward/backward on both sides, accumulated to one optimizer step (default: P*G)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="bfloat16: fp32 master weights with bf16 compute on both sides (TRL bf16=True; ours "
                        "training.fsdp.compute_dtype and a bf16 engine)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads (both frameworks)")
    p.add_argument("--sft-steps", type=int, default=None,
                   help="SFT warm-up steps before RL (default: 200 for tiny, 0 = random for the 0.6B shape)")
    p.add_argument("--trl-gradient-checkpointing", action="store_true",
                   help="keep TRL's default gradient checkpointing (off by default: ours does not use it)")
    p.add_argument("--mem-fraction-static", type=float, default=None,
                   help="ours: rollout.engine.mem_fraction_static, SGLang's flag sizing the engine's KV cache beside "
                        "the trainer on the same GPU (default: 40%% of the free memory)")
    p.add_argument("--compile-layers", action="store_true",
                   help="ours: training.compile_decoder_layers (torch.compile'd decoder layers in the trainer)")
    p.add_argument("--work-dir", default="/tmp/miles-bench")
    p.add_argument("--side", choices=["both", "ours", "trl"], default="both",
                   help="inprocess mode: run one side only (see above)")
    p.add_argument("--save", type=Path, default=None, help="with --side: write this side's result here")
    p.add_argument("--compare", type=Path, default=None,
                   help="with --side: the other side's --save file, from a run with the same settings")
    args = p.parse_args(argv)
    if args.side == "both" and (args.save or args.compare):
        p.error("--save and --compare need --side ours or --side trl")
    if args.side != "both" and args.mode != "inprocess":
        p.error("--side needs --mode inprocess")
    return args


OURS_MODES = {"inprocess": "FSDPTrainer.train_step + EmbeddedEngine.generate (RolloutManager, rewards) + weight copy, "
                          "in this process, steps interleaved 1:1 with TRL's",
              "ray": "run_training on local Ray (sync loop, object_store weight sync), runs alternating with TRL's",
              "one_side": "FSDPTrainer.train_step + EmbeddedEngine.generate (RolloutManager, rewards) + weight copy, "
                          "in one process per side on the same machine (--side, --compare)"}


def micro_batch(args: argparse.Namespace) -> int:
    rows = args.prompts * args.samples
    size = args.micro_batch or rows
    if rows % size:
        raise SystemExit(f"--micro-batch {size} must divide P*G = {rows}")
    return size


def ours_config(args: argparse.Namespace, num_steps: int):
    bf16 = ["model.dtype=bfloat16", "training.fsdp.compute_dtype=bfloat16"] if args.dtype == "bfloat16" else []
    return c.local_config([*bf16,
        f"training.num_steps={num_steps}", f"training.lr={args.lr}", f"training.num_threads={args.threads}",
        f"rollout.num_prompts_per_step={args.prompts}", f"rollout.num_samples_per_prompt={args.samples}",
        f"rollout.max_new_tokens={args.max_new_tokens}", "rollout.loop=sync", "checkpoint.interval_steps=100000",
        f"training.micro_batch_size={micro_batch(args)}",
        *([f"rollout.engine.mem_fraction_static={args.mem_fraction_static}"] if args.mem_fraction_static else []),
        *(["training.compile_decoder_layers=true"] if args.compile_layers else [])])


# ---- ours, in-process ------------------------------------------------------------------------
class OursInProcess:
    """One sync RL step as run_loop does it, without actors: rollout -> train -> weight sync."""

    def __init__(self, cfg, model_dir: Path, train_path: Path, device: str):
        from transformers import AutoTokenizer

        from miles_core.data import PromptSource, read_prompts
        from miles_core.engines.embedded.engine import EmbeddedEngine
        from miles_core.engines.embedded.service import engine_args
        from miles_core.evaluation.core import EngineAsGroup
        from miles_core.rollout.engine_group import embedded_server_args
        from miles_core.rollout.manager import RolloutManager
        from miles_core.training.fsdp import FSDPTrainer

        r, self.cfg, self.device = cfg.rollout, cfg, device
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.source = PromptSource(read_prompts(train_path, cfg.data, tokenizer), seed=cfg.seed)
        with c.trainer_device(device):
            self.trainer = FSDPTrainer(str(model_dir), cfg.training, cfg.algorithm, r.temperature, r.max_new_tokens,
                                       cfg.seed, r.num_samples_per_prompt)
        self.engine = EmbeddedEngine(str(model_dir), cfg.model.dtype, cfg.training.num_threads, device,
                                     **engine_args(embedded_server_args(r.engine, r.precision)))
        self.manager = RolloutManager(EngineAsGroup(self.engine), r, r.reward)
        self.step, self.times = 0, []

    def run_step(self) -> dict:
        t0 = time.perf_counter()
        prompts = self.source.next_batch(self.cfg.rollout.num_prompts_per_step)
        samples = self.manager.generate(prompts, seed=self.cfg.seed * 100_003 + self.step * 97)
        t1 = time.perf_counter()
        with c.trainer_device(self.device):
            metrics = self.trainer.train_step(samples)
        t2 = time.perf_counter()
        self.step += 1
        result = self.engine.update_weights_from_tensors(self.trainer.hf_state_dict(), str(self.step))
        assert result["success"], result
        t3 = time.perf_counter()
        record = {"step": t3 - t0, "rollout": t1 - t0, "train": t2 - t1, "sync": t3 - t2,
                  "reward": sum(s.reward for s in samples) / len(samples),
                  "response_len": sum(len(s.response_ids) for s in samples) / len(samples),
                  "loss": metrics["train/loss"]}
        self.times.append(record)
        c.log(f"ours step {self.step}: {record['step']:.3f} s (rollout {record['rollout']:.3f}, "
              f"train {record['train']:.3f}, sync {record['sync']:.4f}); engine KV cache {c.kv_cache_shape(self.engine)}")
        return record


# ---- ours, on Ray ----------------------------------------------------------------------------
def run_ours_ray(args, model_dir: Path, train_path: Path, run_dir: Path) -> list[dict]:
    import ray

    from miles_core.driver.session import TrainSpec, run_training

    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, configure_logging=False)
    cfg = ours_config(args, args.skip + args.steps)
    spec = TrainSpec(config=cfg, model_dir=str(model_dir), train_path=str(train_path), run_dir=str(run_dir))
    history = run_training(spec, on_metrics=lambda step, m: c.log(
        f"ours(ray) step {step}: {m['time/step_seconds']:.3f} s")).history
    return [{"step": h["time/step_seconds"], "rollout": h["time/rollout_seconds"],
             "train": h["time/train_seconds"], "sync": h["weights/sync_seconds"],
             "reward": h["rollout/reward_mean"], "response_len": h["rollout/response_len_mean"],
             "loss": h["train/loss"]} for h in history]


# ---- TRL -------------------------------------------------------------------------------------
def exact_match_reward(prompts, completions, label, **_):
    """miles_core.rewards.exact_match on the assistant message TRL generated."""
    from miles_core.rewards import exact_match

    texts = [comp[-1]["content"] if isinstance(comp, list) else comp for comp in completions]
    return [exact_match(text, str(gold)) for text, gold in zip(texts, label)]


def trl_dataset(train_path: Path):
    rows = [json.loads(line) for line in train_path.read_text().splitlines() if line.strip()]
    return c.hf_dataset([{"prompt": r["prompt"], "label": r["label"]} for r in rows])


def make_step_timer(between=None):
    """A TrainerCallback timing each optimizer step (on_step_begin -> on_step_end); `between`
    runs after the step's end is recorded (outside the timed window)."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times, self.logs, self._begin = [], [], 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            self._begin = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter() - self._begin)
            c.log(f"trl  step {state.global_step}: {self.times[-1]:.3f} s")
            if between is not None:
                between()

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.logs.append(dict(logs or {}))

    return StepTimer()


def trl_trainer_class():
    """GRPOTrainer that also records how long generation + scoring took in each step."""
    from trl import GRPOTrainer

    class TimedGRPOTrainer(GRPOTrainer):
        rollout_times: list[float] = []

        def _generate_and_score_completions(self, inputs):
            started = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            self.rollout_times.append(time.perf_counter() - started)
            return out

    return TimedGRPOTrainer


def trl_config(args, cfg, max_steps: int, out_dir: Path):
    """cfg is ours_config(args, ...): it holds args' batch, lengths, lr and micro-batch."""
    return c.trl_grpo_config(cfg, out_dir, max_steps, bf16=args.dtype == "bfloat16", cpu=args.device == "cpu",
                             gradient_checkpointing=args.trl_gradient_checkpointing)


def run_trl(args, cfg, model_dir: Path, train_path: Path, out_dir: Path, between=None) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    trainer_cls, timer = trl_trainer_class(), make_step_timer(between)
    trainer_cls.rollout_times = []
    trainer = trainer_cls(model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                          reward_funcs=exact_match_reward, args=trl_config(args, cfg, args.skip + args.steps, out_dir),
                          train_dataset=trl_dataset(train_path),
                          processing_class=AutoTokenizer.from_pretrained(model_dir), callbacks=[timer])
    trainer.train()
    step_logs = [entry for entry in timer.logs if "reward" in entry]
    return [{"step": s, "rollout": r, "train": s - r, "reward": log.get("reward"),
             "response_len": log.get("completions/mean_length"), "loss": log.get("loss")}
            for s, r, log in zip(timer.times, trainer_cls.rollout_times, step_logs)]


# ---- driver ----------------------------------------------------------------------------------
def summarize(keep: list[dict]) -> dict:
    """Medians over the timed steps (warm-up steps already dropped)."""
    out = {f"{key}_seconds_median": c.median(r[key] for r in keep if r.get(key) is not None)
           for key in ("step", "rollout", "train", "sync") if any(key in r for r in keep)}
    for key in ("reward", "response_len"):
        values = [float(r[key]) for r in keep if r.get(key) is not None]
        out[f"{key}_mean"] = sum(values) / len(values) if values else None
    out["step_seconds_all"] = [r["step"] for r in keep]
    return out


def run_inprocess(args, cfg, start_dir: Path, train_path: Path, work: Path) -> tuple[list, list]:
    ours = OursInProcess(cfg, start_dir, train_path, args.device)
    trl = run_trl(args, cfg, start_dir, train_path, work / "trl-out", between=ours.run_step)
    ours.trainer.close()
    return ours.times[args.skip:], trl[args.skip:]


def run_one_side(args, cfg, start_dir: Path, train_path: Path, work: Path) -> tuple[list, list]:
    if args.side == "trl":
        return [], run_trl(args, cfg, start_dir, train_path, work / "trl-out")[args.skip:]
    ours = OursInProcess(cfg, start_dir, train_path, args.device)
    for _ in range(args.skip + args.steps):
        ours.run_step()
    ours.trainer.close()
    return ours.times[args.skip:], []


# What two one-side runs must share for their ratio to mean anything.
COMPARED_SETTINGS = ("device", "model", "max_new_tokens", "prompts", "samples", "dtype", "lr",
                     "skip", "steps", "threads", "sft_steps", "trl_gradient_checkpointing")


def library_versions() -> dict:
    """What the figures were measured on: the GPU and the versions of both sides' libraries."""
    import trl

    return {**c.gpu_identity(), "trl": trl.__version__}


def side_settings(args) -> dict:
    return {**{key: getattr(args, key) for key in COMPARED_SETTINGS}, "micro_batch": micro_batch(args)}


def saved_side(args) -> tuple[str, list]:
    """The other side's steps from its --save file, refused unless its settings are these."""
    saved = json.loads(args.compare.read_text())
    other = "trl" if args.side == "ours" else "ours"
    if saved.get("side") != other:
        raise SystemExit(f"--compare {args.compare} holds side {saved.get('side')!r}; this run is --side "
                         f"{args.side}, so it needs a --save file of --side {other}")
    differing = {k: (v, saved["settings"].get(k)) for k, v in side_settings(args).items() if saved["settings"].get(k) != v}
    if differing:
        raise SystemExit(f"--compare {args.compare} was run with other settings (this run, saved): {differing}; "
                         f"rerun one side with the other's settings")
    return other, saved["steps"]


def run_ray(args, cfg, start_dir: Path, train_path: Path, work: Path) -> tuple[list, list]:
    ours, trl = [], []
    for repeat in range(args.repeats):
        c.log(f"repeat {repeat + 1}/{args.repeats}: ours on Ray")
        ours += run_ours_ray(args, start_dir, train_path, work / f"ours-run-{time.time_ns()}")[args.skip:]
        c.log(f"repeat {repeat + 1}/{args.repeats}: TRL")
        trl += run_trl(args, cfg, start_dir, train_path, work / "trl-out")[args.skip:]
    return ours, trl


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # FSDP2 would otherwise pick the accelerator
    c.setup_env()
    no_ray = c.stub_ray_if_missing()
    if args.mode == "ray" and no_ray:
        raise SystemExit("--mode ray needs Ray; use --mode inprocess on this machine")
    if args.sft_steps is None:
        args.sft_steps = 250 if args.model == "tiny" else 0
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    model_dir, train_path = c.prepare_model(args.model, work), c.prepare_data(work)
    start_dir = c.sft_warmup(model_dir, train_path, args.sft_steps, work, args.device)
    cfg = ours_config(args, args.skip + args.steps)
    load_before, started = c.load_average(), time.perf_counter()
    other_side = saved_side(args) if args.compare else None  # refused before the run, not after
    runner = run_ray if args.mode == "ray" else run_inprocess if args.side == "both" else run_one_side
    with contextlib.redirect_stdout(sys.stderr):  # Trainer prints its logs; stdout is for the JSON
        ours, trl = runner(args, cfg, start_dir, train_path, work)
    if args.save:
        args.save.write_text(json.dumps({"side": args.side, "settings": side_settings(args),
                                         "steps": ours or trl, "summary": summarize(ours or trl)}))
    if args.side != "both" and not args.compare:
        print(json.dumps(c.rounded({"side": args.side, **side_settings(args), **library_versions(),
                                    **summarize(ours or trl)})), flush=True)
        return {}
    if other_side:
        other, steps = other_side
        ours, trl = (steps, trl) if other == "ours" else (ours, steps)
    o, t = summarize(ours), summarize(trl)
    result = {
        "ours_step_seconds_median": o["step_seconds_median"], "trl_step_seconds_median": t["step_seconds_median"],
        "ratio_trl_over_ours": t["step_seconds_median"] / o["step_seconds_median"],
        # inprocess: step i of each ran back to back, so the ratio of each pair cancels slow load drifts
        "ratio_trl_over_ours_paired_median": c.median(t_["step"] / o_["step"] for o_, t_ in zip(ours, trl))
        if args.mode == "inprocess" and args.side == "both" else None,
        "steps": len(ours), "steps_trl": len(trl), "skipped_warmup_steps": args.skip,
        "batch": {"prompts_per_step": args.prompts, "samples_per_prompt": args.samples,
                  "completions_per_step": args.prompts * args.samples},
        "max_new_tokens": args.max_new_tokens, "micro_batch": micro_batch(args), "dtype": args.dtype, "lr": args.lr,
        "model": args.model, "device": args.device,
        "mode": args.mode, "start_model": "random" if args.sft_steps == 0 else f"sft_warmup_{args.sft_steps}_steps",
        "threads": args.threads, "trl_gradient_checkpointing": args.trl_gradient_checkpointing,
        "ours_mem_fraction_static": args.mem_fraction_static, "ours_compile_decoder_layers": args.compile_layers,
        "ours_measured": OURS_MODES[args.mode if args.side == "both" else "one_side"], "ours": o, "trl": t,
        "load_average_before": load_before, "load_average_after": c.load_average(),
        "wall_seconds": time.perf_counter() - started, **library_versions(),
    }
    print(json.dumps(c.rounded(result)), flush=True)
    return result


if __name__ == "__main__":
    main()
