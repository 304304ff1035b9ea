"""What an engine actor needs of the rollout engine it hosts, whichever engine that is.

Two implementations: the embedded engine's HTTP server (`http_server.ServerHandle`, in the
actor's process) and SGLang (`sglang.client.SGLangLauncher`, a child process). Both serve
SGLang's HTTP API at `url`, and everything that API carries (generation, health, weight
updates from disk or by broadcast) goes through `SGLangClient` and the `Router`, the same
code for both engines. This interface is the rest: tensors handed over in-process, the digest
that verifies a sync, and shutting the server down.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from miles_core.weight_sync.shared import BufferHandle


class RolloutEngine(Protocol):
    @property
    def url(self) -> str:
        """Base URL of the engine's SGLang HTTP API."""
        ...

    def update_weights_from_tensors(self, named_tensors: dict[str, torch.Tensor], weight_version: str) -> dict:
        """Load HF-named tensors handed over in-process (the object-store transport); answers
        {"success", "message"} like SGLang's weight-update endpoints."""
        ...

    def map_shared_weights(self, handle: BufferHandle) -> dict:
        """Map the trainer's shared weight buffer (miles_core.weight_sync.shared) for later loads."""
        ...

    def load_shared_weights(self, weight_version: str) -> dict:
        """Copy the mapped buffer into the served weights, stamped weight_version."""
        ...

    def weights_sha256(self) -> str:
        """Digest of the served weights (`weight_sync.layout.weights_sha256`), to verify a sync."""
        ...

    def stop(self) -> None:
        """Shut the server down; no process or thread of it keeps running."""
        ...
