"""The broadcast group's rank layout: SGLang joins every TP rank of an engine at
rank_offset + tp_rank, so offsets are cumulative and the world is 1 + all engine ranks."""

import ray

from miles_core.weights import BroadcastTransport, broadcast_rank_layout


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
        self.weight_broadcast_endpoint = _Method(("10.0.0.1", 29500))
        self.broadcast_backend = _Method("nccl")
        self.open_weight_broadcast = _Method(lambda *args: setattr(self, "opened", args))


def test_each_engine_joins_at_its_offset_in_a_world_of_all_ranks(monkeypatch):
    joined = []
    monkeypatch.setattr(ray, "get", lambda ref, **_: ref)
    monkeypatch.setattr("miles_core.weights.SGLangClient.init_weights_update_group",
                        lambda self, *args: joined.append((self.base_url, *args)) or {"success": True})
    trainer = _Trainer()
    BroadcastTransport(ranks_per_engine=2)._connect(trainer, ("http://a", "http://b", "http://c"))
    world = 7  # the trainer and three engines of tp 2
    assert trainer.opened == ("10.0.0.1", 29500, world, "miles-weights-1")
    assert [(url, offset, size) for url, _, _, offset, size, _, _ in joined] == [
        ("http://a", 1, world), ("http://b", 3, world), ("http://c", 5, world)]
