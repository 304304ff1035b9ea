"""The training driver: one session of a run, in the process that drives it (the flow's train task
inline, or a Ray Job `python -m miles_core.driver.session`). `session` turns a TrainSpec into a
TrainResult; `run` owns the run's live parts (trainer, engines, transport, evaluator); `loop` and
`schedules` drive rollout -> train -> weight push per step; `placement`, `trainer_group` and
`time_sharing` lay the actors out on the GPUs; `ray_jobs` (in the flow's process) submits and
watches the session as a Ray Job.
"""
