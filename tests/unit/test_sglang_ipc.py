"""The cuda_ipc weight transport's sender: buckets SGLang can read, payloads SGLang's unpickler
admits, requests in SGLang's order. (The CUDA half, a handle mapped by another process, is
tests/gpu/test_sglang_ipc_gpu.py; what SGLang admits: tests/sglang_reader.py.)
"""

from __future__ import annotations

import base64

import pytest
import torch

from miles_core.weight_sync.cuda_ipc import flatten_bucket, send_weights_over_cuda_ipc, serialize_bucket
from miles_core.weight_sync.shared import ALIGN_ELEMENTS
from tests.sglang_reader import SGLangUnpickler, read_as_sglang
from tests.unit.test_sglang_shapes import UPDATE_OK


def weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"model.embed_tokens.weight": torch.randn(37, 5, generator=g),
            "model.layers.0.self_attn.q_proj.weight": torch.randn(3, 7, generator=g),
            "model.norm.weight": torch.randn(5, generator=g).to(torch.bfloat16),
            "lm_head.weight": torch.randn(37, 5, generator=g)}


def test_a_bucket_read_as_sglang_reads_it_gives_each_weight_cast_to_the_engine_dtype():
    named = list(weights().items())
    flat, entries = flatten_bucket(named, torch.bfloat16)
    assert all(e.start_idx % (ALIGN_ELEMENTS * 2) == 0 for e in entries)  # each slice can be viewed as its dtype
    got = read_as_sglang(serialize_bucket(flat, entries))
    assert [name for name, _ in got] == [name for name, _ in named]
    for (_, tensor), (_, received) in zip(named, got):
        assert received.dtype == torch.bfloat16 and received.shape == tensor.shape
        assert torch.equal(received, tensor.to(torch.bfloat16))


def test_a_bucket_laid_out_before_is_laid_out_again_when_a_shape_or_the_dtype_changes():
    first = {"w": torch.arange(6.0).view(2, 3), "b": torch.tensor(1.5), "v": torch.ones(4)}
    resized = {"w": torch.arange(12.0).view(3, 4), "b": torch.tensor(2.5), "v": torch.ones(4)}  # same names
    for state, dtype in ((first, torch.bfloat16), (resized, torch.bfloat16), (first, torch.float32),
                         (first, torch.bfloat16)):
        got = read_as_sglang(serialize_bucket(*flatten_bucket(list(state.items()), dtype)))
        assert [(name, tuple(t.shape), t.dtype) for name, t in got] == \
            [(name, tuple(t.shape), dtype) for name, t in state.items()]
        assert all(torch.equal(received, state[name].to(dtype)) for name, received in got)


def test_the_payload_asks_only_for_globals_both_sglang_versions_admit():
    flat, entries = flatten_bucket(list(weights().items()), torch.float32)
    unpickler = SGLangUnpickler(base64.b64decode(serialize_bucket(flat, entries)))
    unpickler.load()
    assert ("types", "SimpleNamespace") in unpickler.globals  # no SGLang class: nothing to import on the trainer
    assert not any(module.startswith("miles_core") for module, _ in unpickler.globals)


def test_a_sync_sends_every_bucket_in_one_session_and_flushes_once(fake):
    fake.on("POST", "/begin_weight_update", (200, {"success": True, "message": "opened"}))
    fake.on("POST", "/update_weights_from_tensor", (200, UPDATE_OK))
    fake.on("POST", "/end_weight_update", (200, {"success": True, "message": "closed"}))
    state = weights()
    received: dict[str, torch.Tensor] = {}

    sent = send_weights_over_cuda_ipc(state, [fake.url], "7", bucket_bytes=200, dtype=torch.bfloat16)

    paths = [path for _, path, _ in fake.calls]
    updates = fake.bodies("/update_weights_from_tensor")
    assert paths == ["/begin_weight_update", *["/update_weights_from_tensor"] * len(updates), "/end_weight_update"]
    assert len(updates) == 3  # bf16 bytes 370 | 42 + 10 | 370 against 200-byte buckets
    assert [u["flush_cache"] for u in updates] == [False, False, True]
    assert {u["load_format"] for u in updates} == {"flattened_bucket"}
    assert {u["weight_version"] for u in updates} == {"7"}
    for update in updates:
        assert len(update["serialized_named_tensors"]) == 1  # one payload per TP rank (tp_size 1)
        received.update(read_as_sglang(update["serialized_named_tensors"][0]))
    assert received.keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(received[name], tensor.to(torch.bfloat16))
    assert sent >= sum(t.numel() * 2 for t in state.values())


def test_a_refused_bucket_fails_the_sync_and_closes_the_session(fake):
    fake.on("POST", "/begin_weight_update", (200, {"success": True, "message": "opened"}))
    fake.on("POST", "/update_weights_from_tensor",
            (400, {"success": False, "message": "Blocked unsafe global during pickle deserialization"}))
    fake.on("POST", "/end_weight_update", (200, {"success": True, "message": "closed"}))
    with pytest.raises(Exception, match="Blocked unsafe global"):
        send_weights_over_cuda_ipc(weights(), [fake.url], "8", bucket_bytes=1 << 20, dtype=torch.bfloat16)
    assert [path for _, path, _ in fake.calls] == ["/begin_weight_update", "/update_weights_from_tensor",
                                                   "/end_weight_update"]


def test_the_config_names_the_transport_with_its_bucket_size_and_the_engine_dtype():
    from miles_core.config import build_config
    from miles_core.weight_sync.transports import CudaIpcTransport, make_transport

    cfg = build_config({}, ["rollout.engine=sglang", "rollout.weight_transport=cuda_ipc",
                            "rollout.weight_transport.bucket_megabytes=64", "rollout.gpus_per_engine=0.5",
                            "training.gpus_per_trainer=0.5", "placement.layout=colocated"])
    transport = make_transport(cfg.rollout.weight_transport, "unused", verify=False, engine_dtype="bfloat16")
    assert isinstance(transport, CudaIpcTransport)
    assert (transport.bucket_bytes, transport.engine_dtype) == (64 << 20, "bfloat16")
