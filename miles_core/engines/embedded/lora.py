"""LoRA adapters on the embedded engine, served as SGLang serves them (0.5.16-0.5.23): launched with
--enable-lora, --max-lora-rank and --lora-target-modules, adapters come and go by name through
/load_lora_adapter and /unload_lora_adapter, and a /generate names one in `lora_path` (none: the
base weights). What SGLang refuses is refused here with its words and status (400):

- a route or a `lora_path` while LoRA is not enabled;
- loading a name already loaded; an adapter of a rank over --max-lora-rank or on modules outside
  --lora-target-modules (grouped as SGLang's pool groups them: q/k/v, gate/up); not a PEFT folder;
- unloading a name not loaded;
- a `lora_path` never loaded. A name loaded once and unloaded since is loaded again from its
  folder, as SGLang does (its lora_ref_cache).

Unloading takes effect at once for new requests and waits for the requests already admitted with
the adapter (SGLang's wait_for_unload). Where the engine differs, it is stricter: past
--max-loaded-loras a load is refused (SGLang evicts the least recently used adapter), one
/generate call applies one adapter (a batch naming several is refused), and --lora-paths (adapters
preloaded at start) is refused at start.

An adapter is applied by merging it into the weights (miles_core.weight_sync.lora: the arithmetic of the
trainer's merged weights, from an unmerged copy of the adapted weights); a request naming another
adapter, or none, first restores that copy. Under the engine's lock, so a generation never sees a
switch half-done.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from miles_core.engines.sglang.args import lora_pool_modules
from miles_core.weight_sync.lora import AdapterMerger, adapted_modules, read_peft_adapter

NOT_ENABLED = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."


class LoRAServing:
    """The adapters one embedded engine holds, by name; `active` is the one merged into its
    weights now (None: the base)."""

    def __init__(self, server_args: dict):
        self.enabled = bool(server_args.get("enable_lora"))
        self.max_rank = _int(server_args.get("max_lora_rank"))
        modules = server_args.get("lora_target_modules")
        self.target_modules = [modules] if isinstance(modules, str) else list(modules or [])
        self.max_loaded = _int(server_args.get("max_loaded_loras"))
        if self.enabled and server_args.get("lora_paths"):
            raise ValueError("--lora-paths: the embedded engine preloads no adapters; load them with /load_lora_adapter")
        if self.enabled and not (self.max_rank and self.target_modules):
            raise ValueError("When no initial --lora-paths is provided, you need to specify both --max-lora-rank and "
                             "--lora-target-modules for LoRA initialization.")
        self.loaded: dict[str, dict[str, torch.Tensor]] = {}
        self.paths: dict[str, str] = {}
        """Every name ever loaded -> its folder (SGLang's lora_ref_cache)."""
        self.users: dict[str, int] = {}
        self.unloading: set[str] = set()
        self.cond = threading.Condition()
        self.active: str | None = None
        self.merger = AdapterMerger()
        """Unmerged copies of the weights adapters changed (taken at the first merge of each)."""

    # ---- routes (worker threads) ---------------------------------------------------------

    def load(self, name: str, path: str, shapes: dict[str, tuple[int, ...]]) -> dict:
        """/load_lora_adapter; shapes: the model's parameter shapes (what an adapter must fit)."""
        if not self.enabled:
            return update_result(False, NOT_ENABLED, {})
        with self.cond:
            try:
                self._load_locked(name, path, shapes)
            except ValueError as exc:
                return update_result(False, str(exc), self.paths_loaded())
            return update_result(True, "", self.paths_loaded())

    def _load_locked(self, name: str, path: str, shapes: dict[str, tuple[int, ...]]) -> None:
        if name in self.loaded:
            raise ValueError(f"Failed to load LoRA adapter {name} because it is already loaded")
        if self.max_loaded is not None and len(self.loaded) >= self.max_loaded:
            raise ValueError(f"Failed to load LoRA adapter {name}: {len(self.loaded)} adapters are loaded, "
                             f"--max-loaded-loras={self.max_loaded} (the embedded engine evicts none: unload one first)")
        config, payload = read_peft_adapter(path)
        targets = config.get("target_modules") or []
        modules = [targets] if isinstance(targets, str) else list(targets)
        pool = lora_pool_modules(self.target_modules)
        if int(config["r"]) > self.max_rank or ("all" not in pool and not lora_pool_modules(modules) <= pool):
            raise ValueError(f"LoRA adapter {name} with rank {config['r']} is incompatible with the current LoRA "
                             "memory pool configuration. Please ensure that the LoRA adapter's rank is within the "
                             "configured `--max-lora-rank` and that the target modules are included in "
                             "`--lora-target-modules`.")
        _check_fits(name, payload, shapes)
        self.loaded[name], self.paths[name] = payload, str(path)

    def unload(self, name: str) -> dict:
        """/unload_lora_adapter: refused to new requests at once; dropped once those admitted finish."""
        if not self.enabled:
            return update_result(False, NOT_ENABLED, {})
        with self.cond:
            if name not in self.loaded or name in self.unloading:
                return update_result(False, f"LoRA with name {name} does not exist. Loaded LoRAs: "
                                            f"{self.loaded.keys()}", self.paths_loaded())
            self.unloading.add(name)
            self.cond.wait_for(lambda: not self.users.get(name))
            self.unloading.discard(name)
            del self.loaded[name]
            self.cond.notify_all()
            return update_result(True, "", self.paths_loaded())

    def paths_loaded(self) -> dict[str, str]:
        return {name: self.paths[name] for name in self.loaded}

    # ---- requests --------------------------------------------------------------------------

    def acquire(self, lora_path: str | list[str | None] | None, shapes: Callable[[], dict]) -> str | None:
        """The adapter a /generate names (admitted: it stays loaded until `release`); ValueError
        (the caller's 400) in SGLang's words when it cannot be served."""
        names = {lora_path} if not isinstance(lora_path, list) else set(lora_path)
        if names <= {None, ""}:
            return None
        if not self.enabled:
            first = next(n for n in (lora_path if isinstance(lora_path, list) else [lora_path]) if n)
            raise ValueError(f"LoRA adapter '{first}' was requested, but LoRA is not enabled. Please launch the server "
                             "with --enable-lora flag and preload adapters using --lora-paths or /load_lora_adapter "
                             "endpoint.")
        if len(names) > 1:
            raise ValueError(f"one /generate call names adapters {sorted(map(str, names))}: the embedded engine applies "
                             "one adapter per call; send the prompts of each adapter in a request of their own")
        [name] = names
        with self.cond:
            self.cond.wait_for(lambda: name not in self.unloading)
            if name not in self.loaded:
                self._reload_locked(name, shapes)
            self.users[name] = self.users.get(name, 0) + 1
        return name

    def _reload_locked(self, name: str, shapes: Callable[[], dict]) -> None:
        if name not in self.paths:
            raise ValueError(f"Got LoRA adapter that has never been loaded: {name}\n"
                             f"All loaded adapters: {self.paths.keys()}.")
        try:
            self._load_locked(name, self.paths[name], shapes())
        except ValueError as exc:
            raise ValueError(f"Failed to implicitly load LoRA adapter {name}: {exc}") from None

    def release(self, name: str | None) -> None:
        if name is None:
            return
        with self.cond:
            self.users[name] -= 1
            self.cond.notify_all()

    @torch.no_grad()
    def apply(self, name: str | None, live: Callable[[], dict[str, torch.Tensor]]) -> None:
        """Make the live weights the base plus adapter `name` (None: the base). Callers hold the
        engine's lock; an admitted adapter stays loaded until released."""
        if name == self.active:
            return
        state, base = live(), self.merger.base
        if base:  # back to the base first: the next adapter may adapt other modules
            torch._foreach_copy_([state[n] for n in base], list(base.values()))
        self.active = None
        if name is not None:
            merged = self.merger.merged(state, self.loaded[name])
            torch._foreach_copy_([state[n] for n in merged], list(merged.values()))
            self.active = name

    def weights_replaced(self) -> None:
        """A full weight update wrote the base: nothing is merged, and the old base is stale."""
        self.active = None
        self.merger.forget()


def _check_fits(name: str, payload: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]]) -> None:
    for module in adapted_modules(payload):
        a, b = payload[module + ".lora_A.weight"], payload.get(module + ".lora_B.weight")
        shape = shapes.get(f"{module}.weight")
        if b is None or shape is None or (b.shape[0], a.shape[1]) != tuple(shape) or b.shape[1] != a.shape[0]:
            raise ValueError(f"Failed to load LoRA adapter {name}: its factors for {module} do not fit the model "
                             f"(weight {shape}, A {tuple(a.shape)}, B {None if b is None else tuple(b.shape)})")


def update_result(success: bool, error_message: str, loaded_adapters: dict[str, str]) -> dict:
    """SGLang's LoRAUpdateOutput as its LoRA routes answer it (200 on success, else 400)."""
    return {"success": success, "error_message": error_message, "loaded_adapters": loaded_adapters}


def _int(value) -> int | None:
    return None if value is None else int(value)
