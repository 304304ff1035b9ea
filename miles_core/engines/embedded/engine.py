"""The embedded rollout engine: transformers generation behind SGLang's request/response shape.

`generate` takes what SGLang's `POST /generate` takes (token ids, sampling_params,
return_logprob, return_routed_experts) and returns what it returns (output_ids, meta_info with
output_token_logprobs, finish_reason, weight_version and routed_experts), so callers are
engine-agnostic.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
)

from miles_core.engines.embedded.fp8_linear import Fp8Weights, swap_to_fp8_linears
from miles_core.engines.embedded.slot_decoder import (
    Finished,
    Sampling,
    SlotDecoder,
    gumbel_scores,
    pad_rows,
    supports,
    warped_scores,
)
from miles_core.weight_sync.layout import fused_layout, weights_sha256
from miles_core.weight_sync.lora import AdapterMerger, is_adapter_payload, payload_bytes

MEMORY_TAGS = {"weights", "kv_cache", "cuda_graph"}
"""SGLang's GPU memory tags (release/resume_memory_occupation)."""

# A seedless request in a seeded batch gets SGLang's deterministic-sampling default.
SGLANG_DEFAULT_SEED = 42

log = logging.getLogger(__name__)


def split_sampling_params(params: dict | list[dict], num_prompts: int) -> tuple[dict, list[int] | None]:
    """SGLang's `sampling_params` of a batch (one dict, or one per prompt) as one shared set and
    the sampling seed of each prompt (None: unseeded). Like SGLang, a single dict's seed applies
    to every prompt (so n samples of one prompt with one seed are n identical samples)."""
    per_prompt = params if isinstance(params, list) else [params] * num_prompts
    if len(per_prompt) != num_prompts:
        raise ValueError(f"{len(per_prompt)} sampling_params for {num_prompts} prompts")
    unseeded = [{k: v for k, v in p.items() if k != "sampling_seed"} for p in per_prompt]
    if any(p != unseeded[0] for p in unseeded):  # one transformers call takes one set
        raise ValueError("per-prompt sampling_params may differ only in sampling_seed on the embedded engine")
    seeds = [p.get("sampling_seed") for p in per_prompt]
    for seed in seeds:  # SGLang's SamplingParams.verify
        if seed is not None and not isinstance(seed, int):
            raise ValueError(f"sampling_seed must be an integer, got {type(seed).__name__}.")
        if seed is not None and not -(2**63) <= seed <= 2**63 - 1:
            raise ValueError(f"sampling_seed must be in [-2**63, 2**63 - 1], got {seed}.")
    if all(s is None for s in seeds):
        return unseeded[0], None
    return unseeded[0], [SGLANG_DEFAULT_SEED if s is None else s for s in seeds]


class EmbeddedEngine:
    """A transformers model that generates batches of token-id prompts."""

    def __init__(self, model_dir: str, dtype: str = "float32", num_threads: int | None = None,
                 device: str | None = None, max_batch_size: int = 1024, slot_decoding: bool | None = None,
                 mem_fraction_static: float | None = None, quantization: str | None = None):
        """max_batch_size: sequences decoded at once. slot_decoding (default: on CUDA): continuous
        batching over a preallocated KV cache with compiled steps (see slot_decoder); off, each
        chunk of max_batch_size prompts runs through transformers' generate. mem_fraction_static:
        SGLang's flag, bounding the slots' KV cache (slot_decoder.kv_budget_bytes). quantization:
        SGLang's flag; "fp8" holds the decoder projections in block FP8 (fp8_linear), quantizing
        every weight it is sent, as SGLang's fp8 loader does."""
        if quantization not in (None, "fp8"):
            raise ValueError(f"quantization {quantization!r}: the embedded engine serves block FP8 ('fp8') or the "
                             "model's dtype (no --quantization)")
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size (SGLang's --max-running-requests) must be at least 1, got {max_batch_size}")
        if mem_fraction_static is not None and not 0 < mem_fraction_static < 1:
            raise ValueError(f"mem_fraction_static must be in (0, 1), got {mem_fraction_static}")
        if num_threads:
            torch.set_num_threads(num_threads)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.max_batch_size = max_batch_size
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
        self.model.to(self.device).eval()
        for param in self._parameters():  # on CPU, tensors mapped from the checkpoint file: copied to
            if not param.untyped_storage().resizable():  # memory of their own, which release_memory can free
                param.data = param.data.clone()
        self.fp8 = Fp8Weights(self.model) if quantization and swap_to_fp8_linears(self.model) else None
        """Where FP8 weights load (None: the model's dtype throughout)."""
        self.weight_version = "default"  # SGLang's before any update
        # LoRA syncs merge into the weights; this keeps the unmerged copy they merge from.
        self.adapters = AdapterMerger()
        self.eos_ids = eos_token_ids(self.model, self.tokenizer)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_ids[0]
        # Checked between decode steps: True ends the running call with what each sequence has
        # (prompts not started come back empty); how the HTTP service's /abort_request gets in.
        self.interrupted: Callable[[], bool] | None = None
        # FP8 layers inside the compiled decode step have not run on a GPU yet: opt in with slot_decoding=True
        by_default = self.device.type == "cuda" and supports(self.model.config) and self.fp8 is None
        use_slots = by_default if slot_decoding is None else slot_decoding
        if self.device.type == "cuda" and not use_slots:  # several times slower decode: never silent
            log.warning("embedded engine on %s decodes with transformers' generate, not slot decoding (%s)",
                        self.device, "slot_decoding=False" if slot_decoding is False else
                        "FP8 weights: slot decoding with FP8 layers is not yet checked on a GPU; "
                        "slot_decoding=True opts in" if self.fp8 else
                        "slot decoding does not support this model's attention (sliding windows, mixed layers "
                        "or split head sizes)")
        self.decode_path = "slots" if use_slots else "generate"
        """How this engine decodes ("slots" or "generate"): benches report it."""
        # transformers marks the models whose forward compiles as one graph (CUDA graphs need it)
        compile_steps = self.device.type == "cuda" and getattr(self.model, "_can_compile_fullgraph", False)
        self.released_weights: list[tuple[torch.UntypedStorage, int]] = []
        """Storages freed by release_memory(["weights"]) and their sizes, until resume_memory."""
        self.slots = (SlotDecoder(self.model, self.pad_id, max_batch_size, compile_steps, mem_fraction_static)
                      if use_slots else None)

    def update_weights_from_tensors(self, named_tensors: dict[str, torch.Tensor], weight_version: str) -> dict:
        """HF-named weights in either MoE expert layout (see miles_core.weight_sync.layout), or an
        adapter payload (miles_core.weight_sync.lora), merged into the unmerged base copy."""
        if is_adapter_payload(named_tensors) and self.fp8 is not None:
            return {"success": False, "message": "LoRA adapter payloads cannot merge into FP8 weights"}
        if is_adapter_payload(named_tensors):
            try:
                merged = self.adapters.merged(self.model.state_dict(), named_tensors)
            except KeyError as exc:
                return {"success": False, "message": str(exc)}
            with torch.no_grad():
                live = self.model.state_dict()
                for name, tensor in merged.items():
                    live[name].copy_(tensor)
            self.weight_version = str(weight_version)
            return {"success": True, "message": f"merged {len(merged)} adapted weights at version {weight_version}",
                    "received_bytes": payload_bytes(named_tensors)}
        self.adapters.forget()
        if any(name.endswith("mlp.experts.gate_up_proj") for name, _ in self.model.named_parameters()):
            named_tensors = fused_layout(named_tensors)
        received = payload_bytes(named_tensors)
        named_tensors, loaded = self._load_fp8(named_tensors)
        missing, unexpected = self.model.load_state_dict(named_tensors, strict=False)
        missing = [k for k in missing if (k != "lm_head.weight" or not self.model.config.tie_word_embeddings)
                   and k not in loaded]
        if missing or unexpected:
            return {"success": False, "message": f"missing={missing[:5]} unexpected={unexpected[:5]}"}
        self.weight_version = str(weight_version)
        return {"success": True, "message": f"weights at version {weight_version}", "received_bytes": received}

    def _load_fp8(self, named_tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], set[str]]:
        """Loads the tensors bound for FP8 layers (quantizing them); returns the others, and the
        state names now loaded (an FP8 layer's scales come with its quantized weight)."""
        if self.fp8 is None:
            return named_tensors, set()
        live = self.model.state_dict()
        fp8 = [n for n in named_tensors if n in live and self.fp8.layer_of(live[n]) is not None]
        self.fp8.copy([live[n] for n in fp8], [named_tensors[n] for n in fp8])
        loaded = {m for n in fp8 for m in (n, n.removesuffix(".weight") + ".weight_scale_inv")}
        return {n: t for n, t in named_tensors.items() if n not in fp8}, loaded

    def copy_weights(self, targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
        """Copies resolved sources into live tensors (the HTTP service's loads), quantizing those
        bound for FP8 layers."""
        if self.fp8 is not None:
            self.fp8.copy(targets, sources)
        else:
            torch._foreach_copy_(targets, sources)

    def release_memory(self, tags: list[str] | None = None) -> None:
        """SGLang's /release_memory_occupation: tags among "weights", "kv_cache" (None: all;
        "cuda_graph" is accepted and keeps its memory). Released weights are gone, not kept on the
        host (SGLang without --enable-weights-cpu-backup): the next weight update refills them.
        Callers hold the engine's lock, so no generation runs meanwhile."""
        tags = MEMORY_TAGS if tags is None else set(tags)
        if "kv_cache" in tags and self.slots is not None:
            self.slots.cache = None  # the next call allocates it again, within its KV budget
        if "weights" in tags and not self.released_weights:
            for param in self._parameters() + (self.fp8.tensors() if self.fp8 else []):
                storage = param.untyped_storage()
                self.released_weights.append((storage, storage.nbytes()))
                storage.resize_(0)  # the Parameter objects stay: loaders and caches keep their references
        if self.device.type == "cuda":  # hand the freed blocks back to the driver, for the trainer's process
            torch.cuda.empty_cache()

    def resume_memory(self, tags: list[str] | None = None) -> None:
        """SGLang's /resume_memory_occupation: weights get their memory back, uninitialised until
        the next weight update; the KV cache is allocated by the next generation."""
        tags = MEMORY_TAGS if tags is None else set(tags)
        if "weights" in tags:
            for storage, nbytes in self.released_weights:
                storage.resize_(nbytes)
            self.released_weights = []

    def _parameters(self) -> list[torch.nn.Parameter]:
        """Distinct parameters (a tied head is its embedding's); buffers such as rotary
        frequencies are no checkpoint tensors, so no update could refill them: they stay."""
        return list({id(p): p for p in self.model.parameters()}.values())

    def weights_sha256(self) -> str:
        """Digest of the engine's weights under HF names (tied lm_head excluded)."""
        state = self.model.state_dict()
        if self.model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        return weights_sha256(state)

    @torch.no_grad()
    def generate(self, input_ids: list[list[int]], sampling_params: dict[str, Any] | list[dict[str, Any]],
                 return_logprob: bool = True, seed: int | None = None, seeds: list[int] | None = None,
                 return_routed_experts: bool = False) -> list[dict[str, Any]]:
        """sampling_params: one dict, or one per prompt as SGLang takes them (their seeds become
        `seeds`). seeds: one sampling seed per prompt (the same prompt and seed give the same
        sample); seed: row i samples with seed + i; neither: torch's global generator.
        return_routed_experts (MoE models): meta_info.routed_experts is a nested list
        [len(prompt) + len(output) - 1, num_layers, top_k] of expert ids."""
        if isinstance(sampling_params, list):
            sampling_params, listed = split_sampling_params(sampling_params, len(input_ids))
            seeds = seeds if seeds is not None else listed
        if seeds is None and seed is not None:
            seeds = [seed + row for row in range(len(input_ids))]
        if seeds is not None and len(seeds) != len(input_ids):
            raise ValueError(f"{len(seeds)} seeds for {len(input_ids)} prompts")
        sampling = self._sampling(sampling_params, seeded=seeds is not None)
        self._check_lengths(input_ids, sampling.max_new_tokens)
        if self.slots is not None:
            finished = self.slots.generate(input_ids, seeds, sampling, self.interrupted)
        else:
            finished = []
            for start in range(0, len(input_ids), self.max_batch_size):
                if self._interrupted():  # an interrupted call ends here, not after one step per chunk
                    break
                chunk_seeds = None if seeds is None else seeds[start : start + self.max_batch_size]
                finished.extend(self._generate_batch(input_ids[start : start + self.max_batch_size], sampling,
                                                     return_logprob, chunk_seeds))
            finished.extend(Finished([], [], False) for _ in range(len(input_ids) - len(finished)))
        outputs = [self._response(done, len(ids), sampling, return_logprob) for ids, done in zip(input_ids, finished)]
        if return_routed_experts and not self._interrupted():  # an aborted call: no replay of its samples
            experts = self.routed_experts([ids + out["output_ids"] for ids, out in zip(input_ids, outputs)])
            for out, routed in zip(outputs, experts):
                out["meta_info"]["routed_experts"] = routed.tolist()
        return outputs

    def _interrupted(self) -> bool:
        return self.interrupted is not None and self.interrupted()

    def _check_lengths(self, input_ids: list[list[int]], max_new_tokens: int) -> None:
        """SGLang's request checks (TokenizerManager._validate_one_request and
        _validate_input_ids_in_vocab), with its messages: a prompt and its budget must fit the
        context length, and every id must be in the vocabulary."""
        context, vocab = self.model.config.max_position_embeddings, self.model.config.vocab_size
        for ids in input_ids:
            if len(ids) >= context:
                raise ValueError(f"The input ({len(ids)} tokens) is longer than the model's context length "
                                 f"({context} tokens).")
            if len(ids) + max_new_tokens >= context:
                raise ValueError(
                    f"Requested token count exceeds the model's maximum context length of {context} tokens. You "
                    f"requested a total of {len(ids) + max_new_tokens} tokens: {len(ids)} tokens from the input "
                    f"messages and {max_new_tokens} tokens for the completion. Please reduce the number of tokens "
                    "in the input messages or the completion to fit within the limit.")
            outside = [t for t in ids if not 0 <= t < vocab]
            if outside:
                raise ValueError(f"The input_ids contain {outside[:5]}, outside the vocab size ({vocab}).")

    def _sampling(self, params: dict[str, Any], seeded: bool) -> Sampling:
        """SGLang's SamplingParams, as its __init__ normalises and verify() checks them: a
        temperature under 1e-6 is greedy, top_k -1 is off; ignore_eos turns off every stop id
        (EOS and stop_token_ids alike), as SGLang's Req.check_finished does."""
        temperature, top_p = float(params.get("temperature", 1.0)), float(params.get("top_p", 1.0))
        top_k = int(params.get("top_k", -1))
        if temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {temperature}.")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}.")
        if top_k != -1 and top_k < 1:
            raise ValueError(f"top_k must be -1 (disable) or at least 1, got {top_k}.")
        greedy = temperature < 1e-6
        stop_ids = () if params.get("ignore_eos") else (*self.eos_ids, *params.get("stop_token_ids", ()))
        return Sampling(temperature=0.0 if greedy else temperature, top_p=top_p, top_k=None if top_k == -1 else top_k,
                        max_new_tokens=int(params.get("max_new_tokens", 16)), stop_ids=tuple(dict.fromkeys(stop_ids)),
                        seeded=seeded and not greedy)

    def _generate_batch(self, input_ids: list[list[int]], sampling: Sampling, return_logprob: bool,
                        seeds: list[int] | None) -> list[Finished]:
        """transformers' generate with a dynamic cache (the CPU path): per-step logits are kept
        for the log-probs, which at the tiny model's vocabulary costs little."""
        batch, attention = self._left_pad(input_ids)
        processors = LogitsProcessorList(
            [SeededSampling(seeds, sampling.temperature, sampling.top_p, sampling.top_k)] if sampling.seeded else [])
        sample_in_hf = not sampling.greedy and not sampling.seeded  # a seeded sample is the argmax of its scores
        config = GenerationConfig(
            do_sample=sample_in_hf,
            # explicit values: None would take the model's generation_config or transformers' top_k=50
            temperature=sampling.temperature if sample_in_hf else None,
            top_p=sampling.top_p if sample_in_hf else None,
            top_k=(sampling.top_k or 0) if sample_in_hf else None,
            max_new_tokens=sampling.max_new_tokens,
            # with no stop ids, an id no step can sample: None would take the model's default EOS
            eos_token_id=list(sampling.stop_ids) or [self.model.config.vocab_size],
            pad_token_id=self.pad_id,
            return_dict_in_generate=True,
            output_logits=return_logprob,
        )
        interrupt = StoppingCriteriaList([Interrupt(self.interrupted)] if self.interrupted else [])
        out = self.model.generate(input_ids=batch, attention_mask=attention, generation_config=config,
                                  logits_processor=processors, stopping_criteria=interrupt)
        new_tokens = out.sequences[:, batch.shape[1]:]
        logprobs = torch.zeros(new_tokens.shape)
        if return_logprob:
            scale = 1.0 if sampling.greedy else sampling.temperature
            logprobs = (torch.log_softmax(torch.stack(out.logits, dim=1).float() / scale, dim=-1)
                        .gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)).cpu()
        finished = []
        for ids, lps in zip(new_tokens.cpu().tolist(), logprobs.tolist()):
            stop_at = next((i for i, t in enumerate(ids) if t in sampling.stop_ids), None)
            count = sampling.max_new_tokens if stop_at is None else stop_at + 1
            finished.append(Finished(ids[:count], lps[:count], count < sampling.max_new_tokens))
        return finished

    def _expert_gates(self) -> list[torch.nn.Module]:
        """The router of every decoder layer, in layer order (Qwen3-MoE: layers[i].mlp.gate)."""
        gates = [getattr(layer.mlp, "gate", None) for layer in self.model.model.layers]
        if not gates or any(g is None for g in gates) or not getattr(self.model.config, "num_experts", None):
            raise ValueError(f"return_routed_experts needs an MoE model with a router in every layer; "
                             f"{type(self.model).__name__} has none")
        return gates

    def _topk_experts(self, gate_output) -> torch.Tensor:
        # transformers >= 5 routers return (logits, weights, indices): take HF's own choice;
        # older ones return logits and the MoE block does softmax then top-k, as here.
        if isinstance(gate_output, tuple):
            return gate_output[2]
        probs = torch.softmax(gate_output, dim=-1, dtype=torch.float)
        return torch.topk(probs, self.model.config.num_experts_per_tok, dim=-1).indices

    @torch.no_grad()
    def routed_experts(self, sequences: list[list[int]], rows_per_pass: int = 16) -> list[torch.Tensor]:
        """Expert ids [len(seq) - 1, num_layers, top_k] per sequence, from a teacher-forced pass
        with hooks on the routers. Right padding keeps positions 0..n-1 of each real token, as
        in the trainer's forward, and the causal mask keeps pads out of the real tokens."""
        gates, captured = self._expert_gates(), []
        hooks = [g.register_forward_hook(lambda _m, _i, out: captured.append(self._topk_experts(out)))
                 for g in gates]
        routed = []
        try:
            for start in range(0, len(sequences), rows_per_pass):
                rows = sequences[start : start + rows_per_pass]
                batch, attention = self._right_pad(rows)
                captured.clear()
                self.model(input_ids=batch, attention_mask=attention)
                per_layer = torch.stack([c.reshape(*batch.shape, -1) for c in captured], dim=2)  # [b, s, L, k]
                routed.extend(per_layer[row, : len(ids) - 1].to(torch.int32).cpu() for row, ids in enumerate(rows))
        finally:
            for hook in hooks:
                hook.remove()
        return routed

    def _left_pad(self, input_ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        return self._pad(input_ids, left=True)

    def _right_pad(self, input_ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        return self._pad(input_ids, left=False)

    def _pad(self, input_ids: list[list[int]], left: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Generation pads left, teacher-forced passes right (see slot_decoder.pad_rows)."""
        return pad_rows(input_ids, self.pad_id, self.device, left)

    def _response(self, done: Finished, prompt_len: int, sampling: Sampling, return_logprob: bool) -> dict:
        ids = done.token_ids
        finish = ({"type": "stop", "matched": ids[-1]} if done.stopped
                  else {"type": "length", "length": sampling.max_new_tokens})
        meta = {
            "finish_reason": finish,
            "prompt_tokens": prompt_len,
            "completion_tokens": len(ids),
            "weight_version": self.weight_version,
        }
        if return_logprob:
            meta["output_token_logprobs"] = [[float(lp), t, None] for lp, t in zip(done.logprobs, ids)]
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return {"text": text, "output_ids": ids, "meta_info": meta}


def eos_token_ids(model, tokenizer) -> list[int]:
    """Every id that ends a sequence, as SGLang collects them: the tokenizer's EOS and the
    model config's and generation config's eos_token_id (an id or a list)."""
    ids = [tokenizer.eos_token_id]
    for config in (model.config, getattr(model, "generation_config", None)):
        value = getattr(config, "eos_token_id", None)
        ids += value if isinstance(value, list) else [value]
    return list(dict.fromkeys(i for i in ids if i is not None))


class Interrupt(StoppingCriteria):
    """Ends transformers' generate for every row once `check` returns True."""

    def __init__(self, check: Callable[[], bool]):
        self.check = check

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), self.check(), dtype=torch.bool, device=input_ids.device)


class SeededSampling(LogitsProcessor):
    """Sampling with one seed per row, as SGLang samples each request with its own
    sampling_seed: temperature, top-k and top-p, then Gumbel noise drawn from (seed, decode
    step, token id) alone, so the argmax of the returned scores (greedy decoding) samples the
    row's distribution, and a row's draws do not depend on the rest of the batch."""

    def __init__(self, seeds: list[int], temperature: float, top_p: float = 1.0, top_k: int | None = None):
        self.seeds, self.temperature, self.top_p, self.top_k, self.step = seeds, temperature, top_p, top_k, 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        seeds = torch.tensor(self.seeds, dtype=torch.int64, device=scores.device)
        scores = gumbel_scores(warped_scores(scores, self.temperature, self.top_k, self.top_p), seeds, self.step)
        self.step += 1
        return scores
