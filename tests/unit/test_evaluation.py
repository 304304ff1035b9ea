"""pass@k estimator, evaluate_dataset on a scripted engine, evaluate_all and the external command."""

import itertools
import json
import shlex
import sys
from math import comb

import pytest

from miles_core.config import ArithmeticTaskConfig, build_config
from miles_core.data import read_prompts, write_arithmetic_task
from miles_core.evaluation.core import (
    ExternalEvalError,
    evaluate_all,
    evaluate_dataset,
    evaluate_greedy,
    pass_at_k,
    run_external_eval,
)
from miles_core.types import EvalResult, Prompt

# ---- pass@k ------------------------------------------------------------------------------------

def test_pass_at_k_hand_computed():
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - comb(3, 2) / comb(5, 2)) == pytest.approx(0.7)
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)  # k=1 is c/n
    assert pass_at_k(7, 0, 3) == 0.0
    assert pass_at_k(5, 4, 2) == 1.0  # n-c=1 < k: every pair holds a correct sample
    assert pass_at_k(4, 4, 4) == 1.0


@pytest.mark.parametrize("n", range(1, 8))
def test_pass_at_k_matches_brute_force_over_subsets(n):
    for c in range(n + 1):
        samples = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(samples, k))
            expected = sum(any(s) for s in subsets) / len(subsets)
            assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12), (n, c, k)


def test_pass_at_k_is_stable_for_large_n_and_rejects_bad_arguments():
    # C(2000, 1000) overflows a float; the product does not
    assert pass_at_k(2000, 3, 1000) == pytest.approx(1 - (998 / 1998) * (999 / 1999) * (1000 / 2000), rel=1e-12)
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(3, 1, 4)
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)


# ---- evaluate_dataset on a scripted engine ------------------------------------------------------

class ScriptedEngine:
    """Returns, for the j-th request of prompt i, script[i][j]; records every call."""

    def __init__(self, script: dict[int, list[str]]):
        self.script, self.served, self.calls = script, {i: 0 for i in script}, []

    def generate(self, input_ids, sampling_params, return_logprob=True, seed=None):
        self.calls.append({"batch": len(input_ids), "params": dict(sampling_params), "seed": seed})
        outputs = []
        for ids in input_ids:
            prompt = ids[0]
            outputs.append({"text": self.script[prompt][self.served[prompt]]})
            self.served[prompt] += 1
        return outputs


def prompts(n: int) -> list[Prompt]:
    return [Prompt(i, f"q{i}", "1", [i, 100 + i]) for i in range(n)]


# correct per prompt out of 4: 4, 1, 0, 2
SCRIPT = {0: ["1", "1", "1", "1"], 1: ["1", "0", "0", "0"], 2: ["0", "0", "x", "0"], 3: ["0", "1", "1", "0"]}


def test_sampled_pass_at_k_and_avg_are_exact():
    engine = ScriptedEngine(SCRIPT)
    result = evaluate_dataset(engine, prompts(4), "exact_match", num_samples=4, temperature=0.7, top_p=0.9,
                              max_new_tokens=5, batch_size=3, pass_k=[1, 2, 4, 8], seed=11)
    assert result.pass_at_1 == pytest.approx((1 + 0.25 + 0 + 0.5) / 4)
    assert result.pass_at_k[2] == pytest.approx((1 + (1 - 3 / 6) + 0 + (1 - 1 / 6)) / 4)
    assert result.pass_at_k[4] == pytest.approx(0.75)
    assert 8 not in result.pass_at_k and "pass@8" not in result.to_json()  # k > n is not estimable
    assert result.mean_reward_at_n[4] == pytest.approx(7 / 16)
    assert result.num_prompts == 4 and result.num_samples_per_prompt == 4
    assert result.examples[1] == {"prompt": "q1", "label": "1", "responses": SCRIPT[1],
                                     "rewards": [1.0, 0.0, 0.0, 0.0]}
    # 16 sequences in batches of 3, sampling settings passed through; row i of the batch starting
    # at sequence s samples with seed 11 + s + i, so every sequence has a seed of its own
    assert [c["batch"] for c in engine.calls] == [3, 3, 3, 3, 3, 1]
    assert engine.calls[0]["params"] == {"temperature": 0.7, "top_p": 0.9, "max_new_tokens": 5}
    assert [c["seed"] for c in engine.calls] == [11 + start for start in range(0, 16, 3)]


def test_avg_at_n_is_mean_reward_not_accuracy_for_signed_rewards():
    script = {i: [f"Answer: {t}" for t in texts] for i, texts in SCRIPT.items()}
    result = evaluate_dataset(ScriptedEngine(script), prompts(4), "dapo", num_samples=4, temperature=1.0,
                              max_new_tokens=5, batch_size=16)
    assert result.pass_at_1 == pytest.approx(7 / 16)
    assert result.mean_reward_at_n[4] == pytest.approx((7 - 9) / 16)  # dapo scores +1 / -1


def test_greedy_matches_evaluate_greedy_and_refuses_several_samples():
    script = {0: ["1"], 1: ["2"], 2: ["1"], 3: ["x"], 4: ["1"], 5: ["1"], 6: ["0"], 7: ["1"], 8: ["1"], 9: ["3"]}
    result = evaluate_dataset(ScriptedEngine(script), prompts(10), "exact_match", max_new_tokens=4, batch_size=4)
    assert result.pass_at_1 == pytest.approx(0.6) and result.mean_reward_at_n[1] == pytest.approx(0.6)
    assert len(result.examples) == 8
    greedy = evaluate_greedy(ScriptedEngine(script), prompts(10), "exact_match", 4, 4)
    assert set(greedy.to_json()) == {"pass@1", "num_prompts", "examples"}
    assert greedy.pass_at_1 == result.pass_at_1 and greedy.num_prompts == 10
    assert greedy.examples[1] == {"prompt": "q1", "response": "2", "label": "1", "correct": False}
    with pytest.raises(ValueError, match="greedy"):
        evaluate_dataset(ScriptedEngine(SCRIPT), prompts(4), "exact_match", num_samples=4, temperature=0.0,
                         max_new_tokens=4, batch_size=4)


# ---- evaluate_all on the tiny model ------------------------------------------------------------

def test_evaluate_all_covers_heldout_and_extra_datasets(tiny_model_dir, tmp_path):
    _, eval_path = write_arithmetic_task(ArithmeticTaskConfig(num_train=4, num_eval=12), tmp_path / "data")
    sampled = {"name": "sampled", "path": str(eval_path), "num_samples_per_prompt": 2, "temperature": 1.0}
    cfg = build_config({"eval": {"max_new_tokens": 3, "pass_k": [1, 2], "datasets": [sampled]}})
    results = evaluate_all(cfg, tiny_model_dir, eval_path)
    assert set(results) == {"heldout", "sampled"}
    assert set(results["heldout"].to_json()) >= {"pass@1", "avg@1", "num_prompts", "examples"}
    assert 2 not in results["heldout"].pass_at_k  # greedy: n = 1
    assert set(results["sampled"].to_json()) >= {"pass@1", "pass@2", "avg@2"}
    assert results["sampled"].num_samples_per_prompt == 2

    from miles_core.engines.embedded.engine import EmbeddedEngine

    engine = EmbeddedEngine(str(tiny_model_dir), num_threads=2)
    greedy = evaluate_greedy(engine, read_prompts(eval_path, cfg.data, engine.tokenizer), "exact_match", 3, 256)
    assert results["heldout"].pass_at_1 == greedy.pass_at_1 and results["heldout"].num_prompts == 12
    # the same greedy responses, not just the same (zero) score of a random model
    assert [e["responses"][0] for e in results["heldout"].examples] == [e["response"] for e in greedy.examples]
    assert results["sampled"].num_prompts == 12
    assert results["sampled"].mean_reward_at_n[2] == pytest.approx(results["sampled"].pass_at_1)  # 0/1 rewards

    clash = cfg.model_copy(deep=True)
    clash.eval.datasets[0].name = "heldout"
    with pytest.raises(ValueError, match="heldout"):
        evaluate_all(clash, tiny_model_dir, eval_path)


# ---- external command ---------------------------------------------------------------------------

def _python(code: str, *args: str) -> str:
    return shlex.join([sys.executable, "-c", code, *args])


def test_external_eval_reads_json_and_quotes_paths(tmp_path):
    out = tmp_path / "dir with space" / "eval.json"
    out.parent.mkdir()
    code = "import json,sys; json.dump({'pass@1': 0.25, 'model': sys.argv[1]}, open(sys.argv[2], 'w'))"
    metrics = run_external_eval(_python(code, "{model_dir}", "{output_json}"), "/models/a b", str(out), 60)
    assert metrics.pass_at_1 == 0.25 and metrics.other["model"] == "/models/a b"


def test_external_eval_failures_are_explained(tmp_path):
    out = str(tmp_path / "eval.json")
    with pytest.raises(ExternalEvalError, match=r"exited with 3(.|\n)*cuda went away"):
        run_external_eval(_python("import sys; sys.stderr.write('cuda went away'); sys.exit(3)"), "m", out, 60)
    with pytest.raises(ExternalEvalError, match="timed out"):
        run_external_eval(_python("import time; time.sleep(30)"), "m", out, 0.5)
    with pytest.raises(ExternalEvalError, match="missing or not JSON"):
        run_external_eval(_python("pass"), "m", out, 60)
    (tmp_path / "bad.json").write_text(json.dumps({"accuracy": 1}))
    with pytest.raises(ExternalEvalError, match="numeric 'pass@1'"):
        run_external_eval(_python("pass"), "m", str(tmp_path / "bad.json"), 60)


# ---- reports (no MLflow) ------------------------------------------------------------------------

def test_report_rows_markdown_and_samples():
    from miles_core.evaluation.reports import eval_report, report_markdown, sample_rollouts, summary_metrics

    before = EvalResult.from_json({"pass@1": 0.25, "num_prompts": 4, "examples": []})  # a bare result: held-out
    after = {name: EvalResult.from_json(r) for name, r in {
        "heldout": {"pass@1": 0.5, "num_prompts": 4, "examples": [
            {"prompt": "q", "label": "1", "response": "1", "correct": True}]},
        "aime": {"pass@1": 0.1, "pass@10": 0.4, "pass@2": 0.2, "avg@10": 0.1, "num_prompts": 2, "examples": [
            {"prompt": "p", "label": "7", "responses": ["7", "8"], "rewards": [1.0, 0.0]}]}}.items()}
    report = eval_report(before, after)
    assert [(r["dataset"], r["metric"]) for r in report["rows"]] == [
        ("heldout", "pass@1"), ("aime", "pass@1"), ("aime", "pass@2"), ("aime", "pass@10"), ("aime", "avg@10")]
    assert report["rows"][0] == {"dataset": "heldout", "metric": "pass@1", "before": 0.25, "after": 0.5, "delta": 0.25}
    assert report["rows"][1]["before"] is None and report["rows"][1]["delta"] is None
    markdown = report_markdown(report)
    assert "| heldout | pass@1 | 0.2500 | 0.5000 | +0.2500 |" in markdown
    assert "| aime | pass@10 | - | 0.4000 | - |" in markdown
    samples = sample_rollouts(after)
    assert {"dataset": "aime", "prompt": "p", "label": "7", "response": "8", "reward": 0.0} in samples
    assert {"dataset": "heldout", "prompt": "q", "label": "1", "response": "1", "reward": 1.0} in samples
    assert summary_metrics(after)["aime"] == {"pass@1": 0.1, "pass@10": 0.4, "pass@2": 0.2, "avg@10": 0.1,
                                              "num_prompts": 2}
