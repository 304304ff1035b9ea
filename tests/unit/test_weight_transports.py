"""Weight transports' bookkeeping of engines. The broadcast group's rank layout: SGLang joins
every TP rank of an engine at rank_offset + tp_rank, so offsets are cumulative and the world is
1 + all engine ranks. Transports with per-engine state (a process group, a mapped buffer) set it
up again for an engine restarted at its old URL."""

import pytest
import ray

from miles_core.weight_sync.transports import BroadcastTransport, SharedMemoryTransport, broadcast_rank_layout

OK = {"success": True}


def test_rank_layout_counts_every_tp_rank():
    assert broadcast_rank_layout(3, 1) == ([1, 2, 3], 4)
    assert broadcast_rank_layout(2, 4) == ([1, 5], 9)


class _Method:
    def __init__(self, result):
        self.result = result

    def remote(self, *args):
        return self.result(*args) if callable(self.result) else self.result


class _Trainer:
    def __init__(self):
        self.opened = None
        self.calls: list[str] = []
        self.weight_broadcast_endpoint = _Method(("10.0.0.1", 29500))
        self.broadcast_backend = _Method("nccl")
        self.open_weight_broadcast = _Method(lambda *args: setattr(self, "opened", args))
        self.close_weight_broadcast = self._record("close_weight_broadcast")
        self.broadcast_weights = self._record("broadcast_weights", 1000)
        self.share_weights = self._record("share_weights", "handle")
        self.unlink_shared_weights = self._record("unlink_shared_weights")
        self.write_shared_weights = self._record("write_shared_weights")

    def _record(self, name, result=None):
        return _Method(lambda *args: self.calls.append(name) or result)


class _Engine:
    """An engine actor: a new object per (re)start, as Ray makes a new actor handle."""

    def __init__(self):
        self.mapped = []
        self.map_shared_weights = _Method(lambda handle: self.mapped.append(handle) or OK)
        self.load_shared_weights = _Method(OK)


@pytest.fixture
def engine_http(monkeypatch):
    """ray.get returns what it is given; the engines' group routes are recorded."""
    calls = []
    monkeypatch.setattr(ray, "get", lambda ref, **_: ref)
    monkeypatch.setattr("miles_core.weight_sync.transports.SGLangClient.init_weights_update_group",
                        lambda self, *args: calls.append(("init", self.base_url)) or OK)
    monkeypatch.setattr("miles_core.weight_sync.transports.SGLangClient.destroy_weights_update_group",
                        lambda self, *args: calls.append(("destroy", self.base_url)) or OK)
    return calls


def test_each_engine_joins_at_its_offset_in_a_world_of_all_ranks(monkeypatch):
    joined = []
    monkeypatch.setattr(ray, "get", lambda ref, **_: ref)
    monkeypatch.setattr("miles_core.weight_sync.transports.SGLangClient.init_weights_update_group",
                        lambda self, *args: joined.append((self.base_url, *args)) or {"success": True})
    trainer = _Trainer()
    targets = tuple((_Engine(), url) for url in ("http://a", "http://b", "http://c"))
    BroadcastTransport(ranks_per_engine=2)._connect(trainer, targets)
    world = 7  # the trainer and three engines of tp 2
    assert trainer.opened == ("10.0.0.1", 29500, world, "miles-weights-1")
    assert [(url, offset, size) for url, _, _, offset, size, _, _ in joined] == [
        ("http://a", 1, world), ("http://b", 3, world), ("http://c", 5, world)]


def test_broadcast_rebuilds_its_group_for_an_engine_restarted_at_its_old_url(engine_http):
    trainer, transport = _Trainer(), BroadcastTransport()
    targets = [(_Engine(), "http://a"), (_Engine(), "http://b")]
    transport.push(trainer, targets, 1)
    transport.push(trainer, targets, 2)
    assert engine_http == [("init", "http://a"), ("init", "http://b")]  # one group for both pushes
    engine_http.clear()
    targets[0] = (_Engine(), "http://a")  # restarted: a new process that never joined a group
    transport.push(trainer, targets, 3)
    # only the engine that still holds the old group is asked to leave it; both join the new one
    assert engine_http == [("destroy", "http://b"), ("init", "http://a"), ("init", "http://b")]
    assert trainer.calls.count("broadcast_weights") == 3


def test_shared_memory_maps_a_fresh_buffer_for_an_engine_restarted_at_its_old_url(engine_http):
    trainer, transport = _Trainer(), SharedMemoryTransport()
    first, other = _Engine(), _Engine()
    transport.push(trainer, [(first, "http://a"), (other, "http://b")], 1)
    transport.push(trainer, [(first, "http://a"), (other, "http://b")], 2)
    assert trainer.calls == ["share_weights", "unlink_shared_weights", "write_shared_weights"]
    restarted = _Engine()
    transport.push(trainer, [(restarted, "http://a"), (other, "http://b")], 3)
    assert trainer.calls[3:] == ["share_weights", "unlink_shared_weights"]
    assert (first.mapped, restarted.mapped, other.mapped) == (["handle"], ["handle"], ["handle", "handle"])


def test_an_engine_maps_a_shared_buffer_once_and_loads_each_write(tiny_model_dir):
    """The engine side of a shared-memory sync on a real server: names and shapes are checked
    when the buffer is mapped (a buffer laid out for another model is refused there), and every
    load copies what the trainer last wrote."""
    import torch

    from miles_core.engines.embedded.http_server import serve
    from miles_core.weight_sync.shared import SharedWeights

    with serve(tiny_model_dir) as server:
        live = dict(server.engine.model.named_parameters())
        weights = {name: torch.randn_like(p) for name, p in live.items()}
        trainer_side = SharedWeights.create(weights, torch.float32)
        wrong = SharedWeights.create({"model.not_a_layer.weight": torch.zeros(3)}, torch.float32)
        try:
            refused = server.map_shared_weights(wrong.handle)
            assert not refused["success"] and "not_a_layer" in refused["message"]
            assert server.map_shared_weights(trainer_side.handle)["success"]
            for version in ("1", "2"):
                trainer_side.write(weights)
                assert server.load_shared_weights(version)["success"]
                assert all(torch.equal(live[n], weights[n]) for n in weights)
                weights = {name: t + 1 for name, t in weights.items()}
            assert server.engine.weight_version == "2"
        finally:
            trainer_side.close()
            wrong.close()


def test_fp8_broadcast_announces_and_sends_block_fp8_linears(monkeypatch):
    """rollout.precision=fp8: SGLang's /update_weights_from_distributed allocates each tensor from
    the announced dtype and shape, so the announcement must name float8_e4m3fn weights followed by
    their float32 weight_scale_inv, and the broadcast must send exactly those tensors in that order."""
    import contextlib

    import torch

    from miles_core.weight_sync.transports import broadcast_to_engines

    announced, sent = [], []
    monkeypatch.setattr("miles_core.weight_sync.transports.SGLangClient.weight_update_session",
                        lambda self: contextlib.nullcontext())
    monkeypatch.setattr("miles_core.weight_sync.transports.SGLangClient.update_weights_from_distributed",
                        lambda self, names, dtypes, shapes, *_: announced.extend(zip(names, dtypes, shapes)) or OK)

    class _Done:
        def wait(self):
            return None

    monkeypatch.setattr(torch.distributed, "broadcast", lambda t, **_: sent.append(t) or _Done())
    state = {"model.embed_tokens.weight": torch.randn(10, 64), "model.layers.0.self_attn.o_proj.weight": torch.randn(64, 200),
             "model.norm.weight": torch.ones(64)}
    broadcast_to_engines(state, None, ["http://e0"], "g", "3", bucket_bytes=1 << 20, dtype=torch.bfloat16, fp8=True)
    assert announced == [("model.embed_tokens.weight", "bfloat16", [10, 64]),
                         ("model.layers.0.self_attn.o_proj.weight", "float8_e4m3fn", [64, 200]),
                         ("model.layers.0.self_attn.o_proj.weight_scale_inv", "float32", [1, 2]),
                         ("model.norm.weight", "bfloat16", [64])]
    assert [t.dtype for t in sent] == [torch.bfloat16, torch.float8_e4m3fn, torch.float32, torch.bfloat16]
