"""A local Ray's workers import the actors' modules before they take work (start_local_ray):
an actor's process already holds torch, transformers and the engine when its __init__ runs."""

import ray

from miles_core.config import load_config
from miles_core.run import EMBEDDED_ENGINE_MODULE, TRAINER_BACKENDS, actor_modules
from tests.conftest import REPO


def test_actor_modules_follow_the_recipe():
    fsdp = load_config(REPO / "configs/local.yaml", [])
    assert actor_modules(fsdp) == [TRAINER_BACKENDS["fsdp2"][0], EMBEDDED_ENGINE_MODULE]
    assert actor_modules(fsdp, with_trainer=False) == [EMBEDDED_ENGINE_MODULE]
    megatron = load_config(REPO / "configs/local-megatron.yaml", [])
    assert actor_modules(megatron)[0] == TRAINER_BACKENDS["megatron"][0]


def test_actors_start_in_workers_that_already_imported_the_trainer_and_the_engine(ray_local):
    watched = [TRAINER_BACKENDS["fsdp2"][0], EMBEDDED_ENGINE_MODULE, "torch", "transformers"]

    @ray.remote(num_cpus=0)
    class Probe:  # defined here, so that its process imports nothing of this module
        def __init__(self):
            import sys

            self.found = [name for name in watched if name in sys.modules]

        def preloaded(self) -> list[str]:
            return self.found

    probes = [Probe.remote() for _ in range(3)]  # more than the workers Ray starts idle
    assert ray.get([p.preloaded.remote() for p in probes]) == [watched] * 3
