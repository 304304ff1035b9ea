"""Per-step metrics reach MLflow exactly once across a kill, even one that cuts a flush short."""

import pytest
from mlflow.tracking import MlflowClient

from miles_core.tracking.runs import MetricsLogger

PROBE = "time/step_seconds"
NUM_KEYS = 600  # two steps of these do not fit one MLflow batch (1000 metrics)


def step_metrics(step: int, num_keys: int = NUM_KEYS) -> dict[str, float]:
    # the probe first, as a dict built in any order may have it
    return {PROBE: float(step), **{f"train/m{i:04d}": float(step * 10_000 + i) for i in range(num_keys)}}


@pytest.fixture()
def run(tmp_path):
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    return client, client.create_run(client.create_experiment("metrics")).info.run_id


def flush_killed_after_one_batch(logger: MetricsLogger, monkeypatch) -> None:
    log_batch, sent = logger.client.log_batch, []

    def killed_after_one(run_id, metrics):
        if sent:
            raise KeyboardInterrupt("killed mid-flush")
        sent.append(len(metrics))
        log_batch(run_id, metrics=metrics)
    monkeypatch.setattr(logger.client, "log_batch", killed_after_one)
    with pytest.raises(KeyboardInterrupt):
        logger.flush()


def test_a_flush_killed_between_batches_leaves_no_step_half_written(run, monkeypatch):
    client, run_id = run
    logger = MetricsLogger(client.tracking_uri, run_id)
    for step in (1, 2, 3):
        logger.log(step, step_metrics(step))
    flush_killed_after_one_batch(logger, monkeypatch)

    resumed = MetricsLogger(client.tracking_uri, run_id)  # the retry: recomputes steps 1-3 and logs them
    assert resumed.logged_through == 1
    for step in (1, 2, 3):
        resumed.log(step, step_metrics(step))
    resumed.flush()
    for key in (PROBE, "train/m0000", f"train/m{NUM_KEYS - 1:04d}"):
        assert sorted(m.step for m in client.get_metric_history(run_id, key)) == [1, 2, 3], key


def test_a_step_over_mlflows_batch_limit_is_split_with_its_probe_last(run, monkeypatch):
    client, run_id = run
    logger = MetricsLogger(client.tracking_uri, run_id)
    logger.log(1, step_metrics(1, num_keys=1200))
    flush_killed_after_one_batch(logger, monkeypatch)

    resumed = MetricsLogger(client.tracking_uri, run_id)
    assert resumed.logged_through == 0  # the first piece alone does not mark the step written
    resumed.log(1, step_metrics(1, num_keys=1200))
    resumed.flush()
    assert [m.value for m in client.get_metric_history(run_id, "train/m1199")] == [11199.0]
    assert MetricsLogger(client.tracking_uri, run_id).logged_through == 1


def test_the_runs_curves_come_whole_from_mlflow_across_sessions(run):
    """What the summary and plots read: every step either session logged, once per step."""
    from miles_core.evaluation.reports import periodic_points_of_run
    from miles_core.tracking.runs import metric_history

    client, run_id = run
    first = MetricsLogger(client.tracking_uri, run_id)
    for step in (1, 2):
        first.log(step, {PROBE: 1.0, "rollout/reward_mean": step / 10})
    first.log(2, {"eval/periodic/heldout/pass_at_1": 0.25})
    first.flush()
    resumed = MetricsLogger(client.tracking_uri, run_id)  # the next session, after a resume at step 2
    for step in (1, 2, 3, 4):
        resumed.log(step, {PROBE: 1.0, "rollout/reward_mean": step / 10})
    resumed.log(4, {"eval/periodic/heldout/pass_at_1": 0.5, "eval/periodic/gsm/pass_at_1": 0.1})
    resumed.flush()
    assert metric_history(client.tracking_uri, run_id, "rollout/reward_mean") == [(1, .1), (2, .2), (3, .3), (4, .4)]
    assert periodic_points_of_run(client.tracking_uri, run_id) == {"gsm": [(4, 0.1)],
                                                                   "heldout": [(2, 0.25), (4, 0.5)]}
