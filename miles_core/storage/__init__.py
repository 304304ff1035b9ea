"""Storage: what a run reads and writes that outlives a process. Run directories and checkpoints
(complete only once their manifest exists), the object store through fsspec (verified uploads,
atomic JSON), background checkpoint uploads, model sources materialised to local directories, and
the deterministic artifacts a run starts from (model, dataset, warm-up, conversion). Checkpoints
and uploads run in the driver process; artifacts and model sources in the flow's artifact tasks.
"""
