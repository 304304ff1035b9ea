"""The embedded engine's continuous batching (miles_core.engines.embedded.slot_decoder): with fewer slots
than prompts, refilled slots must give what transformers' generate gives each prompt, log-probs
included, and stop where SGLang stops."""

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from miles_core.engines.embedded import slot_decoder
from miles_core.engines.embedded.engine import EmbeddedEngine

SAMPLINGS = [
    ({"temperature": 0.0, "max_new_tokens": 12}, None),
    ({"temperature": 1.0, "max_new_tokens": 12}, 5),
    ({"temperature": 0.8, "top_k": 5, "top_p": 0.9, "max_new_tokens": 9}, 1),
]


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    reference = EmbeddedEngine(str(tiny_model_dir), num_threads=1, slot_decoding=False)
    slots = EmbeddedEngine(str(tiny_model_dir), num_threads=1, slot_decoding=True, max_batch_size=4)
    return reference, slots


def prompts(num: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(5, 60, (int(n),), generator=g).tolist() for n in torch.randint(3, 12, (num,), generator=g)]


def logprobs(out: dict) -> list[float]:
    return [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]


def attended_widths(monkeypatch, call):
    """call()'s result, and (query rows, key columns) of each attention it ran, in order."""
    attended, sdpa = [], torch.nn.functional.scaled_dot_product_attention

    def recorded(query, key, *args, **kwargs):
        attended.append((query.shape[-2], key.shape[-2]))
        return sdpa(query, key, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(torch.nn.functional, "scaled_dot_product_attention", recorded)
        return call(), attended


@pytest.mark.parametrize("params,seed", SAMPLINGS)
def test_refilled_slots_give_what_generate_gives(engines, params, seed, monkeypatch):
    reference, slots = engines
    prefilled = []
    prefill = slot_decoder._Run._prefill
    monkeypatch.setattr(slot_decoder._Run, "_prefill", lambda run, taken: prefilled.append(len(taken)) or prefill(run, taken))
    work = prompts(10)
    want = reference.generate(work, params, seed=seed)
    got = slots.generate(work, params, seed=seed)
    assert slots.slots.cache.layers[0].keys.shape[0] == 4
    assert prefilled[0] == 4 and sum(prefilled) == 10 and len(prefilled) > 2  # finished slots took the next prompts
    for a, b in zip(want, got):
        assert b["output_ids"] == a["output_ids"]
        assert b["meta_info"]["finish_reason"] == a["meta_info"]["finish_reason"]
        torch.testing.assert_close(logprobs(b), logprobs(a), rtol=0, atol=1e-5)
    assert any(o["meta_info"]["finish_reason"]["type"] == "stop" for o in got) or seed is None


def test_stop_ids_end_sequences_as_sglang_ends_them(engines, monkeypatch):
    """SGLang's Req.check_finished: the budget first (a stop id as the last allowed token is
    "length"), then stop_token_ids and every EOS id; ignore_eos turns all stop ids off."""
    work = prompts(3)
    free = engines[0].generate(work, {"temperature": 0.0, "max_new_tokens": 10, "ignore_eos": True})
    first = free[0]["output_ids"]
    stop = first[4]
    for engine in engines:
        ends = {stop, *engine.eos_ids}
        cut = next(i for i, t in enumerate(first) if t in ends) + 1
        out = engine.generate(work, {"temperature": 0.0, "max_new_tokens": 10, "stop_token_ids": [stop]})
        assert out[0]["output_ids"] == first[:cut]
        assert out[0]["meta_info"]["finish_reason"] == {"type": "stop", "matched": first[cut - 1]}
        at_budget = engine.generate(work, {"temperature": 0.0, "max_new_tokens": cut, "stop_token_ids": [stop]})
        assert at_budget[0]["output_ids"] == first[:cut]
        assert at_budget[0]["meta_info"]["finish_reason"] == {"type": "length", "length": cut}
        ignored = engine.generate(work, {"temperature": 0.0, "max_new_tokens": 10, "stop_token_ids": [stop],
                                         "ignore_eos": True})
        assert [o["output_ids"] for o in ignored] == [o["output_ids"] for o in free]
        assert {o["meta_info"]["finish_reason"]["type"] for o in ignored} == {"length"}
        monkeypatch.setattr(engine, "eos_ids", [stop])
        ended = engine.generate(work, {"temperature": 0.0, "max_new_tokens": 10})
        assert ended[0]["output_ids"] == first[: first.index(stop) + 1]


def test_sampling_params_sglang_refuses_are_refused(engines):
    for engine in engines:
        for params, message in [({"top_k": 0}, "top_k must be -1"), ({"top_p": 0.0}, "top_p must be in"),
                                ({"temperature": -0.5}, "temperature must be non-negative")]:
            with pytest.raises(ValueError, match=message):
                engine.generate([[5, 6]], {"max_new_tokens": 2, **params})
        assert len(engine.generate([[5, 6]], {"max_new_tokens": 2, "top_k": -1}, seed=0)[0]["output_ids"]) >= 1


def test_every_call_decodes_on_the_decoders_one_thread(tiny_model_dir, engines, monkeypatch):
    """Compiled steps keep their CUDA graphs per thread: calls from a pool of threads (the HTTP
    server, evaluation) must all decode on one, with grad off there too."""
    reference, _ = engines
    engine = EmbeddedEngine(str(tiny_model_dir), num_threads=1, slot_decoding=True)
    seen, run = [], slot_decoder._Run.run_to_completion

    def recording(self, interrupted):
        seen.append((threading.current_thread().name, torch.is_grad_enabled()))
        return run(self, interrupted)

    monkeypatch.setattr(slot_decoder._Run, "run_to_completion", recording)
    params = {"temperature": 1.0, "max_new_tokens": 4}
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda i: engine.generate(prompts(3), params, seed=i), range(6)))
    assert len(seen) == 6 and {name for name, _ in seen} == {"slot-decoder_0"} and not any(g for _, g in seen)
    assert [o["output_ids"] for o in got[5]] == [o["output_ids"] for o in reference.generate(prompts(3), params, seed=5)]


def test_kv_budget_follows_sglangs_mem_fraction_static():
    gib = 2**30
    # SGLang: what is free, less the (1 - fraction) of the total left for others
    assert slot_decoder.kv_budget_bytes(60 * gib, 80 * gib, 0.5) == 20 * gib
    assert slot_decoder.kv_budget_bytes(60 * gib, 80 * gib, None) == int(slot_decoder.KV_CACHE_FRACTION * 60 * gib)
    with pytest.raises(RuntimeError, match="increase --mem-fraction-static"):
        slot_decoder.kv_budget_bytes(60 * gib, 80 * gib, 0.2)
    for bad in (0.0, 1.0, 1.5):
        with pytest.raises(ValueError, match="mem_fraction_static must be in"):
            EmbeddedEngine("unused", mem_fraction_static=bad)
    with pytest.raises(ValueError, match="max-running-requests"):
        EmbeddedEngine("unused", max_batch_size=0)


def test_the_kv_cache_holds_only_the_slots_its_budget_allows(tiny_model_dir, engines, monkeypatch, caplog):
    reference, _ = engines
    engine = EmbeddedEngine(str(tiny_model_dir), num_threads=1, slot_decoding=True)
    config = engine.model.config
    columns = slot_decoder.COLUMN_MULTIPLE
    per_slot = 2 * config.num_hidden_layers * config.num_key_value_heads * columns * config.head_dim * 4
    monkeypatch.setattr(engine.slots, "_kv_budget_bytes", lambda: 3 * per_slot)
    work = prompts(7)
    params = {"temperature": 1.0, "max_new_tokens": 6}
    got = engine.generate(work, params, seed=3)
    assert engine.slots.cache.layers[0].keys.shape[:3] == (3, config.num_key_value_heads, columns)
    assert "holds 3 of the 7 sequences of 128 tokens" in caplog.text and "mem_fraction_static" in caplog.text
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in reference.generate(work, params, seed=3)]
    longer = {"temperature": 1.0, "max_new_tokens": 140}  # 256 columns: within the same bytes, 1 slot
    got = engine.generate(work, longer, seed=4)
    assert engine.slots.cache.layers[0].keys.shape[:3] == (1, config.num_key_value_heads, 2 * columns)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in reference.generate(work, longer, seed=4)]
    # A call that wants more slots than the wide cache holds gets a cache of its own width:
    # the same bytes hold 3 slots of 128 columns.
    got = engine.generate(work, params, seed=5)
    assert engine.slots.cache.layers[0].keys.shape[:3] == (3, config.num_key_value_heads, columns)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in reference.generate(work, params, seed=5)]


def test_long_sequences_widen_the_attended_window_and_a_short_call_reuses_the_cache(engines, monkeypatch):
    """Decode steps attend the first 128 columns, then 256 once a slot can pass 128; a later call
    with fewer prompts and tokens decodes a corner of the same cache."""
    reference, slots = engines
    params = {"temperature": 1.0, "max_new_tokens": 150, "ignore_eos": True}
    work = prompts(5)
    long, attended = attended_widths(monkeypatch, lambda: slots.generate(work, params, seed=11))
    assert slots.slots.cache.layers[0].keys.shape[2] == 256
    assert {width for _, width in attended if width >= 128} == {128, 256}  # prefills attend their prompts' widths
    assert [o["output_ids"] for o in long] == [o["output_ids"] for o in reference.generate(work, params, seed=11)]
    cache = slots.slots.cache
    short = slots.generate(work[:2], {"temperature": 1.0, "max_new_tokens": 4}, seed=12)
    assert slots.slots.cache is cache and cache.layers[0].active_slots == 4
    assert [o["output_ids"] for o in short] == [o["output_ids"] for o in reference.generate(
        work[:2], {"temperature": 1.0, "max_new_tokens": 4}, seed=12)]


def test_a_finished_slot_left_empty_does_not_hold_the_window_open(engines, monkeypatch):
    """Four slots: a long prompt finishes in slot 1 at column ~220 and nothing refills it; the
    prompt that refills slot 0 then decodes alone, attending 128 columns, not 256."""
    reference, slots = engines
    params = {"temperature": 1.0, "max_new_tokens": 20, "ignore_eos": True}
    short = prompts(4)
    work = [short[0], [7] * 200, *short[1:]]
    got, attended = attended_widths(monkeypatch, lambda: slots.generate(work, params, seed=31))
    decode_widths = [width for rows, width in attended if rows <= 2]  # grouped query heads, or one token
    assert 256 in decode_widths and decode_widths[-1] == 128
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in reference.generate(work, params, seed=31)]


def test_an_interrupt_ends_the_running_slots_and_leaves_the_waiting_prompts_empty(engines, monkeypatch):
    """What /abort_request relies on: the check runs between decode steps, and the sequences
    keep the tokens they had."""
    reference, slots = engines
    params = {"temperature": 1.0, "max_new_tokens": 50, "ignore_eos": True}
    work = prompts(10)
    monkeypatch.setattr(slots, "interrupted", lambda: True)
    got = slots.generate(work, params, seed=21)
    whole = reference.generate(work, params, seed=21)
    steps = slot_decoder.CHECK_EVERY_STEPS + 1  # the prefill's token, then one check's steps
    assert [len(o["output_ids"]) for o in got] == [steps] * 4 + [0] * 6
    assert all(o["output_ids"] == w["output_ids"][: len(o["output_ids"])] for o, w in zip(got, whole))


def test_a_call_whose_prompts_all_finish_at_prefill_takes_no_decode_step(engines, monkeypatch):
    _, slots = engines
    steps = []
    step = slot_decoder._Run._step
    monkeypatch.setattr(slot_decoder._Run, "_step", lambda run: steps.append(1) or step(run))
    out = slots.generate(prompts(6), {"temperature": 1.0, "max_new_tokens": 1}, seed=2)
    assert [len(o["output_ids"]) for o in out] == [1] * 6 and steps == []


def test_models_with_other_attention_are_not_slot_decoded(tiny_model_dir):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_model_dir)
    assert slot_decoder.supports(config)
    config.layer_types = ["sliding_attention", *config.layer_types[1:]]
    assert not slot_decoder.supports(config)
    engine = EmbeddedEngine(str(tiny_model_dir), num_threads=1, slot_decoding=False)
    engine.model.config.layer_types = config.layer_types
    with pytest.raises(ValueError, match="sliding-window"):
        slot_decoder.SlotDecoder(engine.model, engine.pad_id, 4, compile_steps=False)


def test_compiled_steps_give_what_eager_steps_give(tiny_model_dir, engines):
    """The compiled forward and sampler (on CPU here, without CUDA graphs) across two attended
    windows, then a greedy call on the same compiled steps: what CUDA runs, minus the graphs."""
    reference, _ = engines
    engine = EmbeddedEngine(str(tiny_model_dir), num_threads=1, slot_decoding=True, max_batch_size=4)
    engine.slots = slot_decoder.SlotDecoder(engine.model, engine.pad_id, 4, compile_steps=True)
    work = prompts(6)
    for params, seed, rows in [({"temperature": 1.0, "max_new_tokens": 150, "ignore_eos": True}, 3, 6),
                               ({"temperature": 0.0, "max_new_tokens": 8}, None, 2)]:
        got = engine.generate(work[:rows], params, seed=seed)
        want = reference.generate(work[:rows], params, seed=seed)
        assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
        for a, b in zip(got, want):
            torch.testing.assert_close(logprobs(a), logprobs(b), rtol=0, atol=1e-4)


def test_an_fp8_engine_decodes_in_slots_as_generate_does(tiny_model_dir):
    """An FP8 engine asked for slot decoding gets it (on a GPU its FP8 linears run inside the
    compiled step; opt-in there until a GPU has run it): slots give the tokens and log-probs
    generate gives over the same FP8 weights."""
    reference = EmbeddedEngine(str(tiny_model_dir), num_threads=1, slot_decoding=False, quantization="fp8")
    slots = EmbeddedEngine(str(tiny_model_dir), num_threads=1, slot_decoding=True, max_batch_size=4, quantization="fp8")
    assert slots.decode_path == "slots" and slots.fp8 is not None
    work, params = prompts(6), {"temperature": 1.0, "max_new_tokens": 8}
    want, got = reference.generate(work, params, seed=2), slots.generate(work, params, seed=2)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
    for g, w in zip(got, want):
        assert logprobs(g) == pytest.approx(logprobs(w), abs=1e-4)
