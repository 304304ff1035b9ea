"""Both backends implement the trainer protocol the loop, transports and checkpoints call, and
share one RL step (RLTrainerCore) instead of each keeping a copy."""

import inspect

import pytest

from miles_core.training.core import RLTrainerCore, Trainer
from miles_core.training.fsdp import FSDPTrainer

SHARED_STEP = ("train_step", "sft_step", "compute_logprobs", "_update", "_score", "_loss", "_batch_metrics")


def _backends() -> list[type]:
    megatron = pytest.importorskip("miles_core.training.megatron.trainer")
    return [FSDPTrainer, megatron.MegatronTrainer]


def test_every_backend_implements_the_protocol_and_the_core_hooks():
    protocol = {name for name, _ in inspect.getmembers(Trainer, inspect.isfunction) if not name.startswith("_")}
    hooks = [name for name, fn in vars(RLTrainerCore).items()
             if callable(fn) and "raise NotImplementedError" in inspect.getsource(fn)]
    assert {"train_step", "hf_state_dict", "save_state", "load_state"} <= protocol and "_token_logprobs" in hooks
    for backend in _backends():
        assert all(callable(getattr(backend, name, None)) for name in protocol), backend
        assert [h for h in hooks if getattr(backend, h) is getattr(RLTrainerCore, h)] == [], backend
        # the RL step itself is not overridden
        assert all(getattr(backend, name) is getattr(RLTrainerCore, name) for name in SHARED_STEP), backend
