"""CPU-only compatibility layer for megatron-core (tests and CPU machines only).

megatron-core assumes CUDA: it calls ``torch.cuda.current_device()`` to place buffers
(tensor-parallel layers and mappings, RoPE, GPT model, attention, dist_checkpointing's
exchange/async utilities), ``torch.cuda.synchronize()``, and keeps its RNG streams as CUDA
generator states (``tensor_parallel.random``: ``CudaRNGStatesTracker``,
``model_parallel_cuda_manual_seed``, ``_get_cuda_rng_state`` / ``_set_cuda_rng_state``).

``enable_cpu_mode()`` redirects exactly those calls, and only when
``torch.cuda.is_available()`` is False (on a GPU machine it does nothing):

* inside ``megatron.core.*`` modules only, the global name ``torch`` is replaced by a proxy
  whose ``torch.cuda`` answers ``current_device() -> "cpu"``, ``synchronize()`` /
  ``empty_cache()`` / ``manual_seed()`` as no-ops, and ``get_rng_state`` / ``set_rng_state``
  on the CPU generator; every other attribute is the real ``torch`` / ``torch.cuda``
  (``torch.cuda.is_available()`` still says False). Nothing outside megatron is touched.
* the RNG tracker becomes :class:`CpuRNGStatesTracker`, which keeps its named streams
  (data-parallel / model-parallel / expert-parallel) as CPU generator states.

It is idempotent, and modules of megatron.core imported later are patched on the next call
(``build_gpt_model`` and the converter call it before building anything).
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import types

import torch

_ENABLED = False
# Imported before patching so that their module-level `torch` gets the proxy.
_MODULES = (
    "megatron.core.parallel_state",
    "megatron.core.tensor_parallel",
    "megatron.core.tensor_parallel.random",
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.transformer.moe.moe_layer",
    "megatron.core.dist_checkpointing",
    "megatron.core.dist_checkpointing.optimizer",
    "megatron.core.dist_checkpointing.strategies.torch",
)


class _CudaOnCpu(types.SimpleNamespace):
    """``torch.cuda`` as megatron-core sees it on a CPU-only machine."""

    @staticmethod
    def current_device() -> str:
        return "cpu"

    @staticmethod
    def synchronize(device=None) -> None:
        return None

    @staticmethod
    def empty_cache() -> None:
        return None

    @staticmethod
    def manual_seed(seed: int) -> None:
        # On GPU this seeds the CUDA generator only; the CPU generator is the caller's business
        # (the trainer seeds it), so seeding "CUDA" on a CPU machine touches nothing.
        return None

    @staticmethod
    def get_rng_state(device=None) -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state: torch.Tensor, device=None) -> None:
        torch.set_rng_state(state)

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


class _TorchProxy(types.ModuleType):
    """The real ``torch`` module except for its ``cuda`` attribute."""

    def __init__(self):
        super().__init__("torch")
        self.__dict__["cuda"] = _CudaOnCpu(random=types.SimpleNamespace(
            get_rng_state=_CudaOnCpu.get_rng_state, set_rng_state=_CudaOnCpu.set_rng_state))

    def __getattr__(self, name):
        return getattr(torch, name)


_PROXY = _TorchProxy()


def _cpu_get_rng_state(device="cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


def _tracker_class():
    from megatron.core.tensor_parallel import random as mrandom

    base = getattr(mrandom, "_ORIGINAL_CudaRNGStatesTracker", mrandom.CudaRNGStatesTracker)

    class CpuRNGStatesTracker(base):
        """Megatron's named RNG streams kept as CPU generator states."""

        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self.seeds_.add(seed)
            outer = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)

        @contextlib.contextmanager
        def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            outer = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer)

    return mrandom, base, CpuRNGStatesTracker


def _patch_loaded_modules() -> int:
    patched = 0
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith("megatron.core"):
            continue
        if module.__dict__.get("torch") is torch:
            module.__dict__["torch"] = _PROXY
            patched += 1
    return patched


_TE_SYMBOLS = ("fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss", "fused_permute",
               "fused_permute_with_probs", "fused_sort_chunks_by_index", "fused_sort_chunks_by_index_with_probs",
               "fused_topk_with_score_function", "fused_unpermute", "te_general_gemm")


def define_missing_te_symbols() -> None:
    """megatron-core 0.16.1 without TransformerEngine: `moe_utils` tests `te_general_gemm is not
    None` (router gating) but only binds the name when TE imports, so the MoE router raises
    NameError. Bind the missing TE names to None (any device; harmless when TE is present)."""
    from megatron.core.transformer.moe import moe_utils

    for name in _TE_SYMBOLS:
        moe_utils.__dict__.setdefault(name, None)


def enable_cpu_mode() -> bool:
    """Redirect megatron-core's CUDA calls to the CPU (no-op when CUDA is available).

    Returns True when CPU mode is active. Safe to call any number of times.
    """
    global _ENABLED
    define_missing_te_symbols()
    if torch.cuda.is_available():
        return False
    for name in _MODULES:
        importlib.import_module(name)
    _patch_loaded_modules()
    if not _ENABLED:
        mrandom, base, tracker = _tracker_class()
        mrandom._ORIGINAL_CudaRNGStatesTracker = base
        mrandom.CudaRNGStatesTracker = tracker
        mrandom._get_cuda_rng_state = _cpu_get_rng_state
        mrandom._set_cuda_rng_state = _cpu_set_rng_state
        mrandom.initialize_rng_tracker(force_reset=True)
        _ENABLED = True
    return True
