"""Eval reports: before/after table (JSON + markdown), reward and eval plots, sample rollouts.

Plots are built on bare `matplotlib.figure.Figure` objects (rendered by the Agg canvas when
saved) instead of pyplot: no global backend or figure state, safe in worker threads.
"""

from __future__ import annotations

import json
from typing import Any

from matplotlib.figure import Figure

from miles_core.evaluation.core import EvalResults, by_dataset, eval_metrics
from miles_core.metrics import HELDOUT, PERIODIC, split_eval_metric_name, with_deprecated_aliases
from miles_core.tracking.runs import client_for, metric_history
from miles_core.types import EvalResult

Results = EvalResults | EvalResult | None
"""{dataset: result}, one bare result (the held-out set's), or None (not evaluated)."""

REPORT_ARTIFACT = "eval/report.json"
MAX_SAMPLES_PER_DATASET = 8


def _metric_order(metric: str) -> tuple:
    kind, _, k = metric.partition("@")  # pass@2 before pass@10; unusual names (external evals) last
    return (kind != "pass", kind, int(k) if k.isdigit() else float("inf"), metric)


def summary_metrics(results: Results) -> dict[str, dict[str, Any]]:
    """{dataset: metrics and counts} without the examples: what a run summary keeps."""
    return {name: r.to_json(examples=False) for name, r in by_dataset(results).items()}


def eval_report(before: Results, after: Results) -> dict[str, Any]:
    """Rows (dataset, metric, before, after, delta); a side that was not evaluated is None."""
    before, after = by_dataset(before), by_dataset(after)
    rows = []
    for name in sorted(set(before) | set(after), key=lambda n: (n != HELDOUT, n)):
        old = before[name].metrics() if name in before else {}
        new = after[name].metrics() if name in after else {}
        for metric in sorted(set(old) | set(new), key=_metric_order):
            b, a = old.get(metric), new.get(metric)
            delta = None if a is None or b is None else a - b
            rows.append({"dataset": name, "metric": metric, "before": b, "after": a, "delta": delta})
    sizes = {name: (after.get(name) or before[name]).num_prompts for name in set(before) | set(after)}
    return {"rows": rows, "num_prompts": sizes}


def report_markdown(report: dict[str, Any]) -> str:
    fmt = lambda v, sign="": "-" if v is None else f"{v:{sign}.4f}"  # noqa: E731
    lines = ["| dataset | metric | before | after | delta |", "|---|---|---|---|---|"]
    for r in report["rows"]:
        lines.append(f"| {r['dataset']} | {r['metric']} | {fmt(r['before'])} | {fmt(r['after'])} | "
                     f"{fmt(r['delta'], '+')} |")
    return "\n".join(lines) + "\n"


def reward_curve_figure(rewards: list[float]) -> Figure:
    fig = Figure(figsize=(6, 3.5), dpi=100)
    ax = fig.subplots()
    ax.plot(range(1, len(rewards) + 1), rewards, marker="." if len(rewards) < 50 else None)
    ax.set(xlabel="RL step", ylabel="mean rollout reward", title="Rollout reward")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def eval_figure(before: Results, after: Results, periodic: dict[str, list] | None = None,
                final_step: int | None = None) -> Figure:
    """pass@1 per dataset: before (step 0), periodic [(step, pass@1)] points, after (final_step)."""
    before, after, periodic = by_dataset(before), by_dataset(after), periodic or {}
    fig = Figure(figsize=(6, 3.5), dpi=100)
    ax = fig.subplots()
    last = final_step or max([1, *(int(s) for pts in periodic.values() for s, _ in pts)])
    for name in sorted(set(before) | set(after) | set(periodic)):
        points = [(0, before[name].pass_at_1)] if name in before else []
        points += [(int(s), float(v)) for s, v in periodic.get(name, [])]
        points += [(last, after[name].pass_at_1)] if name in after else []
        xs, ys = zip(*sorted(points)) if points else ((), ())
        ax.plot(xs, ys, marker="o", label=name)
    ax.set(xlabel="RL step", ylabel="pass@1", title="Evaluation", ylim=(-0.02, 1.02))
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize="small")
    fig.tight_layout()
    return fig


def sample_rollouts(results: Results, per_dataset: int = MAX_SAMPLES_PER_DATASET) -> list[dict[str, Any]]:
    """One row per (prompt, response) from each dataset's examples."""
    rows = []
    for name, result in by_dataset(results).items():
        for ex in result.examples[:per_dataset]:
            # evaluate_dataset rows hold lists; evaluate_greedy rows a single response
            responses = ex.get("responses", [ex.get("response")])
            rewards = ex.get("rewards", [float(ex["correct"])] if "correct" in ex else [None])
            for response, reward in zip(responses, rewards):
                rows.append({"dataset": name, "prompt": ex.get("prompt"), "label": ex.get("label"),
                             "response": response, "reward": reward})
    return rows


def periodic_points_of_run(tracking_uri: str, run_id: str, phase: str = PERIODIC) -> dict[str, list[tuple[int, float]]]:
    """{dataset: [(step, pass@1)]} of the run's periodic evaluations, from MLflow (which keeps
    the steps before a resume)."""
    points = {}
    for key in sorted(client_for(tracking_uri).get_run(run_id).data.metrics):
        parts = split_eval_metric_name(key)
        if parts is not None and parts[0] == phase and parts[2] == "pass@1":
            points[parts[1]] = metric_history(tracking_uri, run_id, key)
    return points


def log_eval_metrics(tracking_uri: str, run_id: str, phase: str, results: Results, step: int) -> dict[str, float]:
    """Every pass@k / avg@n of every dataset as an MLflow metric at `step`, and the deprecated
    aliases of those names (miles_core.metrics.DEPRECATED_EVAL_ALIASES); returns the canonical ones."""
    metrics = eval_metrics(phase, results)
    client = client_for(tracking_uri)
    for key, value in with_deprecated_aliases(metrics).items():
        client.log_metric(run_id, key, value, step=step)
    return metrics


def log_report(tracking_uri: str, run_id: str, before: Results, after: Results,
               reward_curve: list[float], periodic: dict[str, list] | None = None,
               final_step: int | None = None) -> dict[str, Any]:
    """Log eval/report.{json,md}, eval/samples.json, plots/{reward_curve,eval}.png to the run."""
    client = client_for(tracking_uri)
    report = eval_report(before, after)
    # Round-trip through JSON so numpy floats or tuples in results cannot break log_dict.
    client.log_dict(run_id, json.loads(json.dumps(report, default=float)), REPORT_ARTIFACT)
    client.log_text(run_id, report_markdown(report), "eval/report.md")
    client.log_dict(run_id, json.loads(json.dumps(sample_rollouts(after or before), default=str)),
                    "eval/samples.json")
    client.log_figure(run_id, reward_curve_figure(list(reward_curve)), "plots/reward_curve.png")
    client.log_figure(run_id, eval_figure(before, after, periodic, final_step), "plots/eval.png")
    return report
