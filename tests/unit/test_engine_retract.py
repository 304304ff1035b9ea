"""pause_generation(mode=retract) on the embedded engine: a running request cut mid-way, a weight
update, continue; its tokens and log-probs equal a hand-built greedy decode that switches weights
at the same token."""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

from miles_core.engines.embedded.service import EngineService

PROMPT = [5, 9, 14, 3, 7]
PAUSE_AT, MAX_NEW = 3, 8


@pytest.fixture(scope="module")
def service(tiny_model_dir) -> EngineService:
    service = EngineService(tiny_model_dir, num_threads=1)
    service.load()
    assert service.engine is not None and service.engine.decode_path == "generate"
    return service


def _perturbed(model) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {k: v + 0.3 * torch.randn(v.shape, generator=generator) for k, v in model.state_dict().items()}


def _greedy_reference(model_dir, new_weights, switch_at: int) -> tuple[list[int], list[float]]:
    """Token by token with full forwards: the first `switch_at` tokens by the original weights."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids, logprobs = list(PROMPT), []
    with torch.no_grad():
        for step in range(MAX_NEW):
            if step == switch_at:
                model.load_state_dict(new_weights)
            logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, -1].float(), dim=-1)
            token = int(logp.argmax())
            ids.append(token)
            logprobs.append(float(logp[token]))
    return ids[len(PROMPT):], logprobs


def _body() -> dict:
    return {"sampling_params": {"temperature": 0.0, "max_new_tokens": MAX_NEW, "ignore_eos": True},
            "return_logprob": True}


def _retract_after(service: EngineService, tokens: int) -> threading.Event:
    """Pause with mode=retract once `tokens` tokens are generated (the CPU path checks once before
    the first step, then after each)."""
    original, calls, hit = service.engine.interrupted, [0], threading.Event()

    def check() -> bool:
        calls[0] += 1
        if calls[0] == tokens + 1:
            service.pause("retract")
            hit.set()
        return original()

    service.engine.interrupted = check
    return hit


def _generate_in_thread(service: EngineService, req) -> tuple[threading.Thread, dict]:
    result: dict = {}
    thread = threading.Thread(target=lambda: result.setdefault("outs", service.generate(req, [PROMPT], _body())))
    thread.start()
    return thread, result


def test_a_retracted_request_continues_after_a_weight_update_as_one_response(service, tiny_model_dir):
    new_weights = _perturbed(service.engine.model)
    hit = _retract_after(service, PAUSE_AT)
    req = service.register(["r1"])
    thread, result = _generate_in_thread(service, req)
    assert hit.wait(60)
    with service.lock:  # free while the request is retracted: the update runs
        assert service.engine.update_weights_from_tensors(new_weights, "1")["success"]
    assert thread.is_alive()  # held until continue
    service.resume()
    thread.join(120)
    out = result["outs"][0]
    ids, logprobs = _greedy_reference(tiny_model_dir, new_weights, PAUSE_AT)
    assert out["output_ids"] == ids
    assert [entry[0] for entry in out["meta_info"]["output_token_logprobs"]] == pytest.approx(logprobs, abs=1e-4)
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    assert (out["meta_info"]["weight_version"], out["meta_info"]["completion_tokens"]) == ("1", MAX_NEW)


def test_a_request_aborted_while_retracted_returns_its_tokens_with_finish_reason_abort(service):
    hit = _retract_after(service, 2)
    req = service.register(["r2"])
    thread, result = _generate_in_thread(service, req)
    assert hit.wait(60)
    service.abort("r2")
    thread.join(120)
    service.resume()
    out = result["outs"][0]
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(out["output_ids"]) == 2 == len(out["meta_info"]["output_token_logprobs"])


def _out(ids, finish, version="0"):
    return {"text": "", "output_ids": ids, "meta_info": {
        "finish_reason": {"type": finish}, "prompt_tokens": 2, "completion_tokens": len(ids), "weight_version": version,
        "output_token_logprobs": [[-0.1 * t, t, None] for t in ids]}}


def test_only_rows_cut_short_continue_and_each_keeps_its_own_budget():
    from miles_core.engines.embedded.retract import merge_continuation, unfinished_rows

    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return " ".join(map(str, ids))

    outs = [_out([1, 2], "stop"), _out([3], "length"), _out([4, 5, 6], "length"), _out([7, 8, 9, 10], "length")]
    assert unfinished_rows(outs, max_new_tokens=4) == [1, 2]  # row 0 stopped, row 3 used its budget
    longer = merge_continuation(outs[1], _out([11, 12, 13], "length", "1"), budget=3, tokenizer=Tok())
    cut = merge_continuation(outs[2], _out([14, 15, 16], "length", "1"), budget=1, tokenizer=Tok())
    stopped = merge_continuation(outs[2], _out([17], "stop", "1"), budget=1, tokenizer=Tok())
    assert longer["output_ids"] == [3, 11, 12, 13] and longer["text"] == "3 11 12 13"
    assert [e[1] for e in longer["meta_info"]["output_token_logprobs"]] == [3, 11, 12, 13]
    assert cut["output_ids"] == [4, 5, 6, 14] and len(cut["meta_info"]["output_token_logprobs"]) == 4
    assert cut["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
    assert (stopped["meta_info"]["finish_reason"]["type"], stopped["meta_info"]["weight_version"]) == ("stop", "1")
    assert unfinished_rows([outs[0], longer, cut, outs[3]], max_new_tokens=4) == []
