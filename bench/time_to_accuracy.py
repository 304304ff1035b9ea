"""Wall time to a held-out accuracy target: this project vs TRL's GRPOTrainer (no vLLM), from
the same warm model, data, reward, batch, lr, lengths and clip range.

    python bench/recipe_learns.py --config configs/gpu-single.yaml --seeds 0 --out /tmp/learn
    python bench/time_to_accuracy.py --config configs/gpu-single.yaml \\
        --ours-result /tmp/learn/seed0/result.json --out /tmp/tta
    python bench/time_to_accuracy.py --config configs/gpu-single.yaml --out /tmp/tta   # runs ours first

Ours is one seed of bench/recipe_learns.py (the way `miles run` runs a recipe): its curve of
held-out greedy pass@1 against RL seconds less periodic-eval seconds. Without --ours-result this
bench runs that seed itself (its own process, with a local Ray). The same --config and --set
overrides must be given as for ours; a result beside its learn.json takes that file's.

TRL starts from ours' warm model (after the SFT warm-up) and trains on the same train file, with
the recipe's reward scoring each completion's text. Each --trl-configs entry, a setting a TRL
user can pick without vLLM, runs --probe-steps optimizer steps (the first not counted); the one
of fastest median step then trains until held-out pass@1 reaches ours' start + --target-gain, or
--max-minutes of wall time pass. Every eval.interval_steps steps its weights go into the same
embedded engine and greedy evaluator ours' periodic eval uses (miles_core.evaluation.core.evaluate_all,
eval.max_new_tokens), on the same held-out file; eval time is taken off TRL's clock as it is off
ours'. Configs:

  fp32_autocast        fp32 weights and Adam, bf16 autocast (bf16=True): ours' precision
  bf16                 weights loaded in bf16, pure bf16 training
  continuous_batching  use_transformers_continuous_batching=True (transformers' generate_batch)
  static_cache         cache_implementation="static" (TRL generates with disable_compile=True)
  fp32                 fp32 without autocast (on CPU it stands in for the bf16 ones, which need CUDA)

Progress goes to stderr; the last stdout line is one JSON object, also written to --out as
tta.json, with the curves as tta.png (when matplotlib imports).

On the lent GPU machine (no PyPI): tests/gpu/carry.py's sets ray and tools (ours) and trl
(TRL, datasets), each installed with `sh tests/gpu/install.sh .whl/gpu/<set>` into /tmp/site,
then PYTHONPATH=/tmp/site python3 bench/time_to_accuracy.py ... --max-minutes 6 (a command
there runs 10 minutes at most).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c
import grpo_vs_trl
import recipe_learns

CONFIGS = ("fp32_autocast", "bf16", "continuous_batching", "static_cache", "fp32")
NEEDS_CUDA = {"fp32_autocast": "bf16 autocast: a GPU precision (the CPU recipe trains in float32)",
              "bf16": "bf16 weights: a GPU precision (the CPU recipe trains in float32)"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(c.REPO / "configs/gpu-single.yaml"))
    p.add_argument("--ours-result", type=Path, default=None, help="a recipe_learns seed's result.json")
    p.add_argument("--seed", type=int, default=0, help="ours' seed when this bench runs it")
    p.add_argument("--num-cpus", type=int, default=None,
                   help="ours' local Ray, when this bench runs it (default: the CPUs, at least 8: Ray's CPUs are "
                        "logical, and the recipe's actors must fit them)")
    p.add_argument("--set", dest="overrides", action="append", default=[], help="extra dotted override")
    p.add_argument("--target-gain", type=float, default=0.2, help="over ours' start pass@1")
    p.add_argument("--trl-configs", nargs="+", choices=CONFIGS, default=list(CONFIGS[:4]))
    p.add_argument("--probe-steps", type=int, default=3, help="per config; the first is not counted")
    p.add_argument("--max-minutes", type=float, default=20.0, help="wall minutes of the TRL run, evals included")
    p.add_argument("--max-steps", type=int, default=100_000, help="TRL optimizer steps at most")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.probe_steps < 2:
        p.error("--probe-steps must be at least 2 (the first step is not counted)")
    return args


# ---- ours ------------------------------------------------------------------------------------
def ours_side(args, root: Path, warnings: list[str]) -> dict:
    """Ours' seed result (read, or run now), with its config and overrides filled into args."""
    if args.ours_result is None:
        c.log(f"running ours: recipe_learns seed {args.seed}")
        result = recipe_learns.spawn(args, args.seed, root / "ours", args.num_cpus or max(8, os.cpu_count() or 1))
    else:
        result = json.loads(args.ours_result.read_text())
        learn = args.ours_result.resolve().parent.parent / "learn.json"
        if learn.is_file():
            run = json.loads(learn.read_text())
            if args.overrides and args.overrides != run["overrides"]:
                raise SystemExit(f"--set {args.overrides} differs from ours' overrides {run['overrides']} ({learn})")
            if Path(args.config).resolve() != Path(run["config"]).resolve():
                warnings.append(f"--config {args.config} is not ours' {run['config']} ({learn})")
            args.overrides = run["overrides"]
        else:
            warnings.append(f"no {learn}: ours' overrides assumed to be --set {args.overrides}")
    if "curve" not in result:
        raise SystemExit(f"ours has no curve: {result.get('error', result)}")
    return result


def time_to(curve: list[dict], target: float) -> dict | None:
    """The first evaluated point at or above target (the start excluded), with a clock."""
    return next((p for p in curve[1:] if p["pass@1"] >= target - 1e-9 and p["train_seconds"] is not None), None)


# ---- TRL -------------------------------------------------------------------------------------
def variant(name: str, cuda: bool) -> dict:
    """What one TRL config sets: the model's load dtype, bf16 (autocast), GRPOConfig extras."""
    import torch

    mixed = {"dtype": torch.float32, "bf16": cuda}  # the base of the generation settings: ours' precision
    return {"fp32_autocast": {"dtype": torch.float32, "bf16": True},
            "bf16": {"dtype": torch.bfloat16, "bf16": True},
            "continuous_batching": {**mixed, "use_transformers_continuous_batching": True},
            "static_cache": {**mixed, "cache_implementation": "static"},
            "fp32": {"dtype": torch.float32, "bf16": False}}[name]


def variant_note(name: str, cuda: bool) -> dict:
    if name == "continuous_batching" and cuda:
        return {"note": "with bf16=True TRL casts the model to bf16 before generate_batch "
                        "(GRPOTrainer._generate_single_turn), so training goes on in bf16 weights"}
    if name == "static_cache":
        return {"note": "TRL builds its GenerationConfig with disable_compile=True: the static cache runs uncompiled"}
    return {}


def trl_reward(name: str):
    """The recipe's reward (miles_core.rewards) on the text of each completion TRL generated."""
    from miles_core.rewards import get_reward

    score = get_reward(name)

    def reward(prompts, completions, label, **_):
        texts = [comp[-1]["content"] if isinstance(comp, list) else comp for comp in completions]
        return [float(score(text, str(gold))) for text, gold in zip(texts, label)]

    reward.__name__ = f"reward_{name}".replace(":", "_").replace(".", "_")
    return reward


def trl_train_set(cfg, train_path: str, tokenizer):
    """The train file's prompts that ours keeps (read_prompts drops those over max_prompt_tokens),
    as TRL tokenises them to ours' ids: chat messages through the chat template, else text."""
    from miles_core.data import read_prompts

    def prompt(messages):
        if isinstance(messages, list) and not cfg.data.apply_chat_template:
            return "".join(m["content"] for m in messages)
        return messages

    return c.hf_dataset([{"prompt": prompt(p.messages), "label": p.label}
                         for p in read_prompts(train_path, cfg.data, tokenizer)])


class HeldOut:
    """The greedy held-out evaluator ours' periodic eval runs, on an embedded engine that takes
    the TRL model's weights."""

    def __init__(self, cfg, model_dir: str, eval_path: str, device: str):
        from miles_core.engines.embedded.engine import EmbeddedEngine
        from miles_core.engines.embedded.service import engine_args
        from miles_core.rollout.engine_group import embedded_server_args

        self.cfg, self.eval_path = cfg, eval_path
        self.engine = EmbeddedEngine(model_dir, cfg.model.dtype, cfg.training.num_threads, device,
                                     **engine_args(embedded_server_args(cfg.rollout.engine, cfg.rollout.precision)))

    def __call__(self, model=None, version: int = 0) -> tuple[float, float, int]:
        """(pass@1, seconds, prompts) of `model`'s weights (None: the engine's own)."""
        from miles_core.evaluation.core import HELDOUT, evaluate_all

        started = time.perf_counter()
        if model is not None:
            state = {k: v.detach() for k, v in model.state_dict().items()}
            done = self.engine.update_weights_from_tensors(state, str(version))
            assert done["success"], done
        result = evaluate_all(self.cfg, None, self.eval_path, engine=self.engine)[HELDOUT]
        return result.pass_at_1, time.perf_counter() - started, result.num_prompts


def run_clock(run: dict):
    """A TrainerCallback timing each optimizer step; every run["interval"] steps (when an
    evaluator is set) it scores the weights outside the clock, and stops at the target,
    the deadline or run["max_steps"]."""
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            run["began"] = time.perf_counter()

        def on_step_end(self, args, state, control, model=None, **kwargs):
            now = time.perf_counter()
            run["step_seconds"].append(now - run["began"])
            c.log(f"trl {run['name']} step {state.global_step}: {run['step_seconds'][-1]:.2f} s")
            if run.get("evaluate") and state.global_step % run["interval"] == 0:
                score, seconds, _ = run["evaluate"](model, state.global_step)
                point = {"step": state.global_step, "rl_seconds": now - run["started"],
                         "train_seconds": now - run["started"] - run["eval_seconds"], "pass@1": score}
                run["curve"].append(point)
                run["eval_seconds"] += seconds
                c.log(f"trl {run['name']} step {state.global_step}: held-out pass@1 {score:.3f} "
                      f"({point['train_seconds']:.0f} s of training, eval {seconds:.1f} s)")
                if score >= run["target"] - 1e-9:
                    run["stopped"], control.should_training_stop = "target", True
            if time.perf_counter() > run["deadline"] and not control.should_training_stop:
                run["stopped"], control.should_training_stop = "max_minutes", True

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                run["rewards"].append(logs["reward"])

    return Clock()


def run_trl(cfg, name: str, ours: dict, out_dir: Path, max_steps: int, *, cuda: bool, evaluate=None,
            target: float = math.inf, deadline: float = math.inf) -> dict:
    """One TRL run of config `name` from ours' warm model; its step times (and curve)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    settings = variant(name, cuda)
    dtype, bf16 = settings.pop("dtype"), settings.pop("bf16")
    run = {"name": name, "step_seconds": [], "rewards": [], "curve": [], "eval_seconds": 0.0, "stopped": "max_steps",
           "evaluate": evaluate, "interval": cfg.eval.interval_steps or max_steps, "target": target,
           "deadline": deadline}
    trainer_cls = grpo_vs_trl.trl_trainer_class()
    trainer_cls.rollout_times = []
    torch.set_num_threads(cfg.training.num_threads)
    run["started"] = time.perf_counter()  # model load and trainer set-up count, as ours' actor starts do
    tokenizer = AutoTokenizer.from_pretrained(ours["warm_model_dir"])
    model = AutoModelForCausalLM.from_pretrained(ours["warm_model_dir"], dtype=dtype)
    trainer = trainer_cls(model=model, reward_funcs=trl_reward(cfg.rollout.reward),
                          args=c.trl_grpo_config(cfg, out_dir, max_steps, bf16=bf16, cpu=not cuda, **settings),
                          train_dataset=trl_train_set(cfg, ours["train_path"], tokenizer), processing_class=tokenizer,
                          callbacks=[run_clock(run)])
    trainer.train()
    run["wall_seconds"] = time.perf_counter() - run["started"]
    run["rollout_seconds"] = list(trainer_cls.rollout_times)
    del trainer, model
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return {k: v for k, v in run.items() if k not in ("evaluate", "began", "started", "deadline", "interval")}


def probe(args, cfg, ours: dict, root: Path, cuda: bool, warnings: list[str]) -> dict:
    """--probe-steps steps of each config: its median step and rollout seconds, first step dropped."""
    names = list(args.trl_configs)
    if not cuda and any(n in NEEDS_CUDA for n in names) and "fp32" not in names:
        names.append("fp32")  # recorded: its probe says why it ran
    probes = {}
    for name in names:
        if not cuda and name in NEEDS_CUDA:
            probes[name] = {"skipped": f"no CUDA; {NEEDS_CUDA[name]}"}
            c.log(f"trl {name}: skipped ({probes[name]['skipped']})")
            continue
        c.log(f"trl {name}: probing {args.probe_steps} steps")
        try:
            run = run_trl(cfg, name, ours, root / f"trl-probe-{name}", args.probe_steps, cuda=cuda)
        except Exception as exc:  # noqa: BLE001 - a config that fails is reported, the others go on
            probes[name] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
            warnings.append(f"trl config {name} failed: {probes[name]['error'][:300]}")
            c.log(f"trl {name}: failed: {probes[name]['error']}")
            continue
        probes[name] = {"step_seconds_median": c.median(run["step_seconds"][1:]),
                        "rollout_seconds_median": c.median(run["rollout_seconds"][1:]),
                        "step_seconds": run["step_seconds"], "reward_median": c.median(run["rewards"]),
                        **variant_note(name, cuda)}
        if name not in args.trl_configs:
            probes[name]["added"] = "no CUDA: stands in for the bf16 configs"
        c.log(f"trl {name}: {probes[name]['step_seconds_median']:.2f} s per step")
    return probes


# ---- report ----------------------------------------------------------------------------------
def plot(ours_curve: list[dict], trl_curve: list[dict], target: float, labels: tuple[str, str], path: Path) -> bool:
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for curve, label in zip((ours_curve, trl_curve), labels):
        points = [p for p in curve if p["train_seconds"] is not None]
        ax.plot([p["train_seconds"] for p in points], [p["pass@1"] for p in points], marker="o", label=label)
    ax.axhline(target, color="grey", linestyle="--", label=f"target {target:.3f}")
    ax.set(xlabel="training seconds (periodic eval excluded)", ylabel="held-out pass@1 (greedy)")
    ax.legend()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    return True


def start_check(ours_before: float, trl_before: float, prompts: int, warnings: list[str]) -> dict:
    """Both start from the same model: their step-0 evals should agree within binomial noise."""
    tolerance = max(0.01, 2 * math.sqrt(max(ours_before * (1 - ours_before), 1e-4) / prompts))
    agree = abs(trl_before - ours_before) <= tolerance
    if not agree:
        warnings.append(f"start pass@1 differs: ours {ours_before:.3f}, TRL's evaluator {trl_before:.3f} "
                        f"(tolerance {tolerance:.3f})")
    return {"ours": ours_before, "trl": trl_before, "tolerance": tolerance, "agree": agree}


def trained_seconds(curve: list[dict]) -> float:
    """Training seconds up to the last evaluated point: a run short of the target took longer."""
    return max((p["train_seconds"] for p in curve if p["train_seconds"] is not None), default=0.0)


def trl_timing(run: dict, target: float, ours: dict) -> dict:
    hit, ours_hit = time_to(run["curve"], target), time_to(ours["curve"], target)
    trained = trained_seconds(run["curve"])
    both = hit and ours_hit and ours_hit["train_seconds"] > 0
    return {"seconds_to_target": hit and hit["train_seconds"], "steps_to_target": hit and hit["step"],
            "ratio_trl_over_ours": hit["train_seconds"] / ours_hit["train_seconds"] if both else None,
            # one side stopped short of the target: bounds on the ratio
            "ratio_trl_over_ours_at_least": trained / ours_hit["train_seconds"] if ours_hit and not hit else None,
            "ratio_trl_over_ours_at_most": hit["train_seconds"] / trained_seconds(ours["curve"])
            if hit and not ours_hit and trained_seconds(ours["curve"]) > 0 else None,
            "stopped": run["stopped"], "steps": len(run["step_seconds"]), "train_seconds": trained,
            "eval_seconds": run["eval_seconds"], "wall_seconds": run["wall_seconds"],
            "step_seconds_median": c.median(run["step_seconds"][1:]),
            "rollout_seconds_median": c.median(run["rollout_seconds"][1:]), "curve": run["curve"]}


def versions() -> dict:
    import trl

    return {**c.gpu_identity(), "trl_version": trl.__version__}


def measure(args, root: Path) -> dict:
    warnings: list[str] = []
    started = time.perf_counter()
    ours = ours_side(args, root, warnings)
    c.stub_ray_if_missing()  # TRL's side needs no Ray: miles_core's modules import where it is absent
    import torch

    from miles_core.config import load_config

    cuda = torch.cuda.is_available()
    cfg = load_config(args.config, [*args.overrides, f"seed={ours['seed']}", f"storage.work_dir={root / 'work'}"])
    target = ours["curve"][0]["pass@1"] + args.target_gain
    ours_hit = time_to(ours["curve"], target)
    probes = probe(args, cfg, ours, root, cuda, warnings)
    timed = {n: p["step_seconds_median"] for n, p in probes.items() if p.get("step_seconds_median") is not None}
    if not timed:
        raise SystemExit(f"no TRL config ran: {json.dumps(probes)}")
    chosen = min(timed, key=timed.get)
    c.log(f"trl: fastest config {chosen} ({timed[chosen]:.2f} s per step); training to pass@1 {target:.3f}")
    evaluate = HeldOut(cfg, ours["warm_model_dir"], ours["eval_path"], "cuda" if cuda else "cpu")
    trl_before, eval_seconds, prompts = evaluate()
    c.log(f"trl: step-0 held-out pass@1 {trl_before:.3f} (ours {ours['before']:.3f}), eval {eval_seconds:.1f} s")
    run = run_trl(cfg, chosen, ours, root / "trl-run", args.max_steps, cuda=cuda, evaluate=evaluate, target=target,
                  deadline=time.perf_counter() + args.max_minutes * 60)
    run["curve"].insert(0, {"step": 0, "rl_seconds": 0.0, "train_seconds": 0.0, "pass@1": trl_before})
    trl = trl_timing(run, target, ours)
    report = c.rounded({
        "bench": "time_to_accuracy", "config": args.config, "overrides": args.overrides, **versions(),
        "target_gain": args.target_gain, "target_pass_at_1": target,
        "start": start_check(ours["before"], trl_before, prompts, warnings),
        "ours": {"seconds_to_target": ours_hit and ours_hit["train_seconds"],
                 "steps_to_target": ours_hit and ours_hit["step"],
                 "result": str(args.ours_result or root / "ours" / f"seed{args.seed}" / "result.json"),
                 "step_seconds_median": ours["median_per_step"].get("time/step_seconds"),
                 "rl_steps": ours.get("rl_steps"), "curve": ours["curve"]},
        "trl": {"config": chosen, **trl}, "ratio_trl_over_ours": trl["ratio_trl_over_ours"], "trl_probes": probes,
        "probe_steps": args.probe_steps, "max_minutes": args.max_minutes, "warnings": warnings,
        "num_warnings": len(warnings), "wall_seconds": time.perf_counter() - started})
    (root / "tta.json").write_text(json.dumps(report, indent=1))
    report["plot"] = str(root / "tta.png") if plot(ours["curve"], run["curve"], target,
                                                     ("ours", f"TRL ({chosen})"), root / "tta.png") else None
    return report


def main(argv=None) -> dict:
    args = parse_args(argv)
    c.setup_env()
    root = args.out or Path(tempfile.mkdtemp(prefix="miles-tta-"))
    root.mkdir(parents=True, exist_ok=True)
    with contextlib.redirect_stdout(sys.stderr):  # libraries print; stdout is for the JSON
        report = measure(args, root)
    print(json.dumps(report), flush=True)
    return report


if __name__ == "__main__":
    main()
