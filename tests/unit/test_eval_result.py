"""EvalResult keeps the eval files' schema, and eval metrics reach MLflow under one naming scheme
with the old flat names still logged as deprecated aliases; the registry tag reads the canonical name."""

import pytest
from mlflow.tracking import MlflowClient

from miles_core import metrics
from miles_core.evaluation import reports
from miles_core.tracking import registry
from miles_core.types import EvalResult

EXTERNAL = {"pass@1": 0.5, "pass@4": 0.75, "avg@4": 0.5, "pass@1_strict": 0.25, "num_prompts": 8,
            "model": "/models/a", "examples": [{"prompt": "p", "label": "1", "response": "1", "correct": True}]}


def test_the_json_form_round_trips_an_external_commands_file():
    result = EvalResult.from_json(EXTERNAL)
    assert result.pass_at_k == {1: 0.5, 4: 0.75} and result.mean_reward_at_n == {4: 0.5}
    assert result.other_metrics == {"pass@1_strict": 0.25} and result.other == {"model": "/models/a"}
    assert result.num_prompts == 8 and result.num_samples_per_prompt is None
    assert result.to_json() == EXTERNAL
    assert result.to_json(examples=False) == {k: v for k, v in EXTERNAL.items() if k != "examples"}
    assert result.metrics() == {"pass@1": 0.5, "pass@4": 0.75, "avg@4": 0.5, "pass@1_strict": 0.25}


@pytest.mark.parametrize("data", [{"accuracy": 1.0}, {"pass@1": "0.5"}, {"pass@1": True}])
def test_a_result_without_a_numeric_pass_at_1_is_refused(data):
    with pytest.raises(ValueError, match="numeric 'pass@1'"):
        EvalResult.from_json(data)


def test_eval_metric_names_are_hierarchical_and_parse_back():
    assert metrics.AFTER_HELDOUT_PASS_AT_1 == "eval/after/heldout/pass_at_1"
    assert metrics.eval_metric_name("periodic", "gsm8k", "avg@4") == "eval/periodic/gsm8k/avg_at_4"
    assert metrics.split_eval_metric_name("eval/periodic/gsm8k/avg_at_4") == ("periodic", "gsm8k", "avg@4")
    assert metrics.split_eval_metric_name("eval/after_pass_at_1") is None
    assert metrics.split_eval_metric_name("train/loss") is None


def test_canonical_names_and_their_deprecated_aliases_are_logged(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("names")).info.run_id
    results = {"heldout": EvalResult(pass_at_k={1: 0.25}), "aime": EvalResult(pass_at_k={1: 0.5, 2: 0.75})}
    reports.log_eval_metrics(uri, run_id, "before", results, step=0)
    returned = reports.log_eval_metrics(uri, run_id, "after", {"heldout": EvalResult(pass_at_k={1: 0.5})}, step=3)
    logged = client.get_run(run_id).data.metrics
    assert logged == {"eval/before/heldout/pass_at_1": 0.25, "eval/before/aime/pass_at_1": 0.5,
                      "eval/before/aime/pass_at_2": 0.75, "eval/after/heldout/pass_at_1": 0.5,
                      "eval/before_pass_at_1": 0.25, "eval/after_pass_at_1": 0.5}
    history = client.get_metric_history(run_id, "eval/after_pass_at_1")
    assert [(m.step, m.value) for m in history] == [(3, 0.5)]  # the alias at the canonical one's step
    assert returned == {"eval/after/heldout/pass_at_1": 0.5}  # callers get canonical names only
    # the registry's score tag is the canonical metric's value, whatever an alias holds
    assert registry.score_tag({**returned, "eval/after_pass_at_1": 0.0}) == {"eval_pass_at_1": "0.5"}
    with pytest.raises(KeyError, match="eval/after/heldout/pass_at_1"):
        registry.score_tag({"eval/after_pass_at_1": 0.5})
