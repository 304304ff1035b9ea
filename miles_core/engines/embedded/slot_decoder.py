"""Continuous batching for the embedded engine: a fixed set of slots over one preallocated KV
cache, a decode step that samples every slot and returns its exact log-prob, and slot refill
(a finished sequence's slot takes the next waiting prompt).

Each slot holds one sequence at cache columns 0..n, so a token's column is its position id;
slots advance independently, which is what lets a refilled slot start over at column 0 while
its neighbours keep decoding. The attention mask of a step is "column <= my position" per slot,
passed to the model as a ready 4D mask, so transformers' mask building and cache offsets are
not involved. On CUDA the model forward runs through transformers' compiled call (CUDA graphs
over the static cache addresses) and the sampler through torch.compile.

The cache only grows. A call decodes the first `slots` rows of it (its prompt count, rounded)
and a step attends only the columns its mask spans (the longest running sequence's reach, rounded
up to COLUMN_MULTIPLE), so short calls and early steps do not pay for the cache's full size. The
mask's width is a dynamic dimension of the compiled step: a slot count compiles once for
windows narrower than the cache and once for its full width, and each width records its own
CUDA graph on first use.

Models whose attention is not one full causal span over keys and values of one head size
(sliding windows, multi-head latent attention) are not supported: `supports()` says which.
"""

from __future__ import annotations

import inspect
import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, DynamicCache, TopKLogitsWarper, TopPLogitsWarper
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

KV_CACHE_FRACTION = 0.4
"""Share of the free accelerator memory the slots' KV cache may take when it is allocated
(without SGLang's --mem-fraction-static)."""
PREFILL_TOKEN_BUDGET = 2**15
"""Prompt tokens one prefill pass may hold (bounds its activations, not its result)."""
CHECK_EVERY_STEPS = 8
"""Decode steps between host checks for finished slots (each check is one device sync)."""
SLOT_MULTIPLE, COLUMN_MULTIPLE = 16, 128
"""Slot counts and cache widths are rounded up to these so compiled steps are reused across calls."""
COMPILED_VARIANTS = 64
"""torch.compile variants the decode step may keep over a process's calls (two per slot count and cache width)."""


SLOT_ATTENTION = "miles_slot_sdpa"
log = logging.getLogger(__name__)


def slot_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None, **kwargs):
    """transformers' SDPA attention, except one-token decode steps of grouped-query models: there
    each key/value head attends its group of query heads as query rows, so the cache is read
    once instead of being copied once per query head (transformers' repeat_kv), which took
    half of a decode step at 256 slots x 384 columns on an H100."""
    batch, query_heads, query_length, head_dim = query.shape
    kv_heads = key.shape[1]
    if attention_mask is not None:
        # a slot cache's keys: attend only the window the mask spans (a no-op elsewhere); its
        # width is a dynamic dimension of the compiled step, so a wider window does not recompile
        key, value = key[:, :, : attention_mask.shape[-1]], value[:, :, : attention_mask.shape[-1]]
    if query_length != 1 or query_heads == kv_heads or dropout:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    grouped = query.reshape(batch, kv_heads, query_heads // kv_heads, head_dim)
    out = F.scaled_dot_product_attention(grouped, key, value, attn_mask=attention_mask, scale=scaling)
    return out.reshape(batch, query_heads, 1, head_dim).transpose(1, 2).contiguous(), None


AttentionInterface.register(SLOT_ATTENTION, slot_attention)
AttentionMaskInterface.register(SLOT_ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


class SlotLayer(CacheLayerMixin):
    """One decoder layer's keys and values for every slot, [slots, kv_heads, columns, head_dim];
    a decode step writes slot s's token at column positions[s] of the first active_slots slots,
    which attend as many columns as the step's mask spans (slot_attention)."""

    is_compileable = True
    is_sliding = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor):
        super().__init__()
        self.keys, self.values, self.positions = keys, values, positions
        self.rows = torch.arange(keys.shape[0], device=keys.device)
        self.device, self.dtype, self.is_initialized = keys.device, keys.dtype, True
        self.active_slots = keys.shape[0]
        for tensor in (self.keys, self.values, self.positions, self.rows):
            torch._dynamo.mark_static_address(tensor)  # in-place updates keep CUDA graphs valid

    def lazy_initialization(self, *args, **kwargs) -> None:
        """Allocated up front: nothing to do."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        slots = self.active_slots
        rows, positions = self.rows[:slots], self.positions[:slots]
        self.keys[rows, :, positions] = key_states[:, :, 0]
        self.values[rows, :, positions] = value_states[:, :, 0]
        return self.keys[:slots], self.values[:slots]

    def get_mask_sizes(self, *args, **kwargs) -> tuple[int, int]:
        return self.keys.shape[2], 0

    def get_seq_length(self, *args, **kwargs) -> int:
        return 0  # positions and the mask are passed in; nothing reads a shared length

    def get_max_length(self) -> int:
        return self.keys.shape[2]


@dataclass(frozen=True)
class Sampling:
    """What one generate call samples with (SGLang's sampling_params, resolved)."""

    temperature: float
    top_p: float
    top_k: int | None
    max_new_tokens: int
    stop_ids: tuple[int, ...]
    seeded: bool

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class Finished:
    """One request's generated tokens, their log-probs, and whether a stop id ended it before
    the budget did."""

    token_ids: list[int]
    logprobs: list[float]
    stopped: bool


def warped_scores(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float) -> torch.Tensor:
    """Scores to sample from: fp32 logits at the temperature, then top-k and top-p (-inf outside)."""
    scores = logits.float() / temperature
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return scores


def gumbel_scores(scores: torch.Tensor, seeds: torch.Tensor, step: int | torch.Tensor) -> torch.Tensor:
    """Scores plus Gumbel noise from counter_uniform(seed, step, token id): their argmax samples
    softmax(scores), and a row's draw depends on nothing but its seed and step."""
    return scores - torch.log(-torch.log(counter_uniform(seeds, step, scores.shape[-1])))


def sample_next(logits: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor,
                sampling: Sampling) -> tuple[torch.Tensor, torch.Tensor]:
    """Next token of every row and its log-prob under the temperature-scaled distribution
    (before top-k/top-p, as SGLang reports it). Seeded rows draw Gumbel noise from (seed, the
    row's own decode step, token id), so a row's sample does not depend on its batch or slot;
    unseeded rows sample with torch's generator."""
    logits = logits.float()
    logprobs = torch.log_softmax(logits / (1.0 if sampling.greedy else sampling.temperature), dim=-1)
    if sampling.greedy:
        tokens = logits.argmax(dim=-1)
    else:
        scores = warped_scores(logits, sampling.temperature, sampling.top_k, sampling.top_p)
        if sampling.seeded:
            tokens = gumbel_scores(scores, seeds, steps).argmax(dim=-1)
        else:
            tokens = torch.multinomial(torch.softmax(scores, dim=-1), 1).squeeze(-1)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


def supports(config) -> bool:
    """Whether slot decoding computes what the model's own attention does: full causal
    attention in every layer, keys and values of one head size."""
    layer_types = getattr(config, "layer_types", None) or ["full_attention"]
    sliding = bool(getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None))
    split_heads = getattr(config, "v_head_dim", None) not in (None, getattr(config, "head_dim", None))
    return set(layer_types) == {"full_attention"} and not sliding and not split_heads


def pad_rows(rows: list[list[int]], pad_id: int, device: torch.device,
             left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Token batch and attention mask of `rows`, padded on the left or the right."""
    width = max(len(ids) for ids in rows)
    batch = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention = torch.zeros_like(batch)
    for row, ids in enumerate(rows):
        cols = slice(width - len(ids), width) if left else slice(0, len(ids))
        batch[row, cols] = torch.tensor(ids)
        attention[row, cols] = 1
    return batch.to(device), attention.to(device)


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class SlotDecoder:
    """Generates for any number of prompts through a bounded set of slots (see module doc)."""

    def __init__(self, model, pad_id: int, max_slots: int, compile_steps: bool,
                 mem_fraction_static: float | None = None):
        if not supports(model.config):
            raise ValueError(f"slot decoding needs full causal attention with one key/value head size; "
                             f"{type(model).__name__} has sliding-window or split-head layers: use slot_decoding=False")
        self.model, self.pad_id, self.max_slots = model, pad_id, max_slots
        self.mem_fraction_static = mem_fraction_static
        self.lock = threading.Lock()  # one call at a time owns the slots and the cache
        # Decoding runs on this one thread, whichever thread calls: torch keeps compiled steps'
        # CUDA graphs per thread (cudagraph trees are thread-local), so callers on a pool of
        # threads (an HTTP server, evaluation) would otherwise record them once per thread.
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="slot-decoder")
        model.set_attn_implementation(SLOT_ATTENTION)
        self.compiled = compile_steps
        if compile_steps:
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, COMPILED_VARIANTS)
        self.forward = model.get_compiled_call(None) if compile_steps else model
        self.sample = torch.compile(sample_next, dynamic=False) if compile_steps else sample_next
        self.cache: Cache | None = None
        # transformers >= 5.24 names the cache argument `cache` (`past_key_values` before)
        self.cache_argument = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def generate(self, prompts: list[list[int]], seeds: list[int] | None, sampling: Sampling,
                 interrupted: Callable[[], bool] | None = None) -> list[Finished]:
        """interrupted: checked between decode steps (every CHECK_EVERY_STEPS); True ends the call
        with what each sequence has, and prompts not started come back empty."""
        columns = round_up(max(len(p) for p in prompts) + sampling.max_new_tokens, COLUMN_MULTIPLE)
        with self.lock:
            num_slots = self._ensure_cache(len(prompts), columns)
            run = _Run(self, prompts, seeds, sampling, num_slots)
            return self.thread.submit(_without_grad, run.run_to_completion, interrupted or (lambda: False)).result()

    def _ensure_cache(self, num_prompts: int, columns: int) -> int:
        """Slots for a call of `num_prompts` prompts needing `columns` columns. A cache that fits
        is kept, so compiled variants and their graphs stay valid across calls; one that does
        not grows to hold both, within the KV budget. Where the budget cannot, the cache is
        rebuilt for this call alone: one long call must not leave every later call few slots."""
        config = self.model.config
        kv_heads = config.num_key_value_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        dtype, device = self.model.dtype, self.model.device
        held = (0, 0, 0) if self.cache is None else self.cache.layers[0].keys.shape
        held_slots, held_columns = held[0], held[2]
        wanted = min(round_up(num_prompts, SLOT_MULTIPLE), self.max_slots)
        if held_slots >= wanted and held_columns >= columns:
            return wanted
        budget = self._kv_budget_bytes()

        def capacity(width: int) -> int:
            return max(1, budget // (2 * config.num_hidden_layers * kv_heads * width * head_dim * dtype.itemsize))

        slots, width = max(wanted, held_slots), max(columns, held_columns)
        if slots > capacity(width):
            slots, width = min(wanted, capacity(columns)), columns
            if held_slots >= slots and held_columns >= columns:
                return min(wanted, held_slots)
        self.cache = None
        positions = torch.zeros(slots, dtype=torch.long, device=device)
        shape = (slots, kv_heads, width, head_dim)
        layers = [SlotLayer(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device),
                            positions) for _ in range(config.num_hidden_layers)]
        self.cache = Cache(layers=layers)
        at_once = min(num_prompts, self.max_slots)
        if slots < at_once:
            # Each round decodes to the longest sequence of its slots, so a call takes about
            # ceil(at_once / slots) times as long as one round.
            log.warning("the KV cache budget (%.1f GiB) holds %d of the %d sequences of %d tokens this call decodes at "
                        "once: it runs in rounds; raise mem_fraction_static (SGLang's --mem-fraction-static) to "
                        "decode them in one", budget / 2**30, slots, at_once, width)
        return min(wanted, slots)

    def _kv_budget_bytes(self) -> int:
        device = self.model.device
        if device.type != "cuda":
            return 2**31
        held = 0 if self.cache is None else sum(2 * layer.keys.nbytes for layer in self.cache.layers)
        free, total = torch.cuda.mem_get_info(device)
        return kv_budget_bytes(free + held, total, self.mem_fraction_static)


def _without_grad(fn: Callable, *args):
    """fn(*args) with grad off, for the whole decode (prefill and steps): grad mode is per
    thread, so the caller's no_grad does not reach the decoder's thread."""
    with torch.no_grad():
        return fn(*args)


def kv_budget_bytes(free_bytes: int, total_bytes: int, mem_fraction_static: float | None) -> int:
    """Bytes the KV cache may take, given the accelerator's free memory (counting a cache already
    held as free). With SGLang's --mem-fraction-static, SGLang's rule (ModelRunner's
    profile_max_num_token): what is free less the (1 - fraction) of the total kept for others,
    such as a colocated trainer; without it, KV_CACHE_FRACTION of what is free."""
    if mem_fraction_static is None:
        return int(KV_CACHE_FRACTION * free_bytes)
    budget = int(free_bytes - total_bytes * (1 - mem_fraction_static))
    if budget <= 0:
        raise RuntimeError(f"Not enough memory for the KV cache: {free_bytes / 2**30:.1f} GiB free of "
                           f"{total_bytes / 2**30:.1f} GiB, and --mem-fraction-static {mem_fraction_static} keeps "
                           f"{(1 - mem_fraction_static) * total_bytes / 2**30:.1f} GiB for others. Please increase "
                           f"--mem-fraction-static.")
    return budget


class _Run:
    """One generate call's state: which request each slot holds, and the device-side counters."""

    def __init__(self, decoder: SlotDecoder, prompts: list[list[int]], seeds: list[int] | None,
                 sampling: Sampling, num_slots: int):
        self.decoder, self.prompts, self.sampling, self.cache = decoder, prompts, sampling, decoder.cache
        first = self.cache.layers[0]
        self.positions, self.columns = first.positions[:num_slots], first.keys.shape[2]
        device = first.keys.device
        self.request_seeds = torch.tensor(seeds if seeds is not None else [0] * len(prompts), dtype=torch.long)
        self.stop_ids = torch.tensor(sampling.stop_ids or (-1,), device=device)
        self.column_ids = torch.arange(self.columns, device=device)
        self.window = COLUMN_MULTIPLE
        self.all_slots = torch.arange(num_slots, device=device)
        self.mask_dtype = first.keys.dtype
        self.slot_request = [-1] * num_slots
        self.seeds = torch.zeros(num_slots, dtype=torch.long, device=device)
        self.generated = torch.zeros(num_slots, dtype=torch.long, device=device)
        self.done = torch.ones(num_slots, dtype=torch.bool, device=device)
        self.tokens = torch.full((num_slots,), decoder.pad_id, dtype=torch.long, device=device)
        self.out_tokens = torch.full((num_slots, sampling.max_new_tokens), decoder.pad_id, dtype=torch.long,
                                     device=device)
        self.out_logprobs = torch.zeros(num_slots, sampling.max_new_tokens, device=device)
        self.positions.zero_()
        self.waiting = deque(range(len(prompts)))
        self.results: list[Finished | None] = [None] * len(prompts)

    def run_to_completion(self, interrupted: Callable[[], bool]) -> list[Finished]:
        """Decodes until every prompt has finished: CHECK_EVERY_STEPS steps at a time, refilling
        the slots that finished in between (and not stepping while none runs)."""
        self._refill(list(range(len(self.slot_request))))
        while any(r >= 0 for r in self.slot_request):
            done = self.done.tolist()
            finished = [s for s, r in enumerate(self.slot_request) if r >= 0 and done[s]]
            if finished:
                self._refill(finished)
                continue
            self._fit_window()
            for _ in range(CHECK_EVERY_STEPS):
                self._step()
            if interrupted():
                self._collect(list(range(len(self.slot_request))))
                return [r if r is not None else Finished([], [], False) for r in self.results]
        return self.results

    def _fit_window(self) -> None:
        """Attend the columns any running slot can reach before the next check, rounded up to
        COLUMN_MULTIPLE. A finished slot left empty (no prompt waits) keeps its last position but
        reads nothing that is kept, so it must not hold the window open for the others."""
        reach = int(torch.where(self.done, 0, self.positions).max()) + CHECK_EVERY_STEPS + 1
        self.window = min(round_up(reach, COLUMN_MULTIPLE), self.columns)
        for layer in self.cache.layers:
            layer.active_slots = len(self.slot_request)

    def _refill(self, free_slots: list[int]) -> None:
        """Collect the finished slots' results and prefill the next waiting prompts into them."""
        if not free_slots:
            return
        self._collect(free_slots)
        taken = [(slot, self.waiting.popleft()) for slot in free_slots[: len(self.waiting)]]
        for slot in free_slots:
            self.slot_request[slot] = -1
        if not taken:
            return
        rows_per_pass = max(1, PREFILL_TOKEN_BUDGET // max(len(self.prompts[r]) for _, r in taken))
        for start in range(0, len(taken), rows_per_pass):
            self._prefill(taken[start : start + rows_per_pass])

    def _collect(self, slots: list[int]) -> None:
        held = [s for s in slots if self.slot_request[s] >= 0]
        if not held:
            return
        counts = self.generated[held].tolist()
        tokens, logprobs = self.out_tokens[held].tolist(), self.out_logprobs[held].tolist()
        stop_ids = set(self.sampling.stop_ids)
        for slot, count, ids, lps in zip(held, counts, tokens, logprobs):
            ids = ids[:count]
            # SGLang checks the budget before stop ids: a stop id as the last allowed token is "length"
            stopped = count < self.sampling.max_new_tokens and bool(ids) and ids[-1] in stop_ids
            self.results[self.slot_request[slot]] = Finished(ids, lps[:count], stopped)

    def _prefill(self, taken: list[tuple[int, int]]) -> None:
        """Runs the prompts left-padded through the model, moves each one's keys and values to
        columns 0..len-1 of its slot, and samples its first token from the last position."""
        device = self.positions.device
        batch, attention = pad_rows([self.prompts[r] for _, r in taken], self.decoder.pad_id, device, left=True)
        width = batch.shape[1]
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        prompt_cache = DynamicCache()
        out = self.decoder.model(input_ids=batch, attention_mask=attention, position_ids=positions, use_cache=True,
                                 logits_to_keep=1, **{self.decoder.cache_argument: prompt_cache})
        lengths = attention.sum(-1)
        source = (torch.arange(width, device=device)[None, :] + (width - lengths)[:, None]).clamp(max=width - 1)
        slots = torch.tensor([s for s, _ in taken], device=device)
        for mine, theirs in zip(self.cache.layers, prompt_cache.layers):
            index = source[:, None, :, None].expand(-1, theirs.keys.shape[1], -1, theirs.keys.shape[3])
            mine.keys[slots, :, :width] = theirs.keys.gather(2, index)
            mine.values[slots, :, :width] = theirs.values.gather(2, index)
        self.seeds[slots] = self.request_seeds[[r for _, r in taken]].to(device)
        self.generated[slots] = 0
        self.positions[slots] = lengths
        self.done[slots] = False
        for slot, request in taken:
            self.slot_request[slot] = request
        self._advance(out.logits[:, -1], slots, sample_next)  # prefill batches vary in size: not compiled

    def _step(self) -> None:
        visible = self.column_ids[None, : self.window] <= self.positions[:, None]
        mask = torch.where(visible, 0.0, torch.finfo(self.mask_dtype).min).to(self.mask_dtype)[:, None, None, :]
        if self.decoder.compiled:
            torch._dynamo.maybe_mark_dynamic(mask, 3)  # one compiled step for windows narrower than the cache
            torch.compiler.cudagraph_mark_step_begin()
        out = self.decoder.forward(input_ids=self.tokens[:, None], attention_mask=mask, position_ids=self.positions[:, None],
                                   use_cache=True, **{self.decoder.cache_argument: self.cache})
        self.positions.add_((~self.done).long()).clamp_(max=self.columns - 1)
        self._advance(out.logits[:, -1], self.all_slots, self.decoder.sample)

    def _advance(self, logits: torch.Tensor, slots: torch.Tensor, sample) -> None:
        """Samples the next token of `slots`, records it for the slots still running, and marks
        the ones that hit a stop token or their budget."""
        tokens, logprobs = sample(logits, self.seeds[slots], self.generated[slots], self.sampling)
        running, count = ~self.done[slots], self.generated[slots]
        index = count.clamp(max=self.sampling.max_new_tokens - 1)
        self.out_tokens[slots, index] = torch.where(running, tokens, self.out_tokens[slots, index])
        self.out_logprobs[slots, index] = torch.where(running, logprobs, self.out_logprobs[slots, index])
        self.generated[slots] = count + running.long()
        finished = torch.isin(tokens, self.stop_ids) | (count + 1 >= self.sampling.max_new_tokens)
        self.done[slots] = self.done[slots] | (running & finished)
        self.tokens[slots] = torch.where(running, tokens, self.decoder.pad_id)


_MIX = (-4658895280553007687, -7723592293110705685, -7046029254386353131)  # splitmix64's odd constants
_LOW_BITS = [(1 << (64 - shift)) - 1 for shift in (30, 27, 31)]


def counter_uniform(seeds: torch.Tensor, step: int | torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Uniforms in (0, 1) of shape [len(seeds), vocab_size], a pure function of (seed, step,
    column): splitmix64's finaliser over a counter, on any device, one pass for the batch.
    step: the decode step of every row, or of each row. int64 products wrap; right shifts are
    masked to make them logical."""
    column = torch.arange(vocab_size, dtype=torch.int64, device=seeds.device)
    steps = torch.as_tensor(step, dtype=torch.int64, device=seeds.device).reshape(-1, 1)
    x = seeds[:, None] * _MIX[0] + (steps * vocab_size + column[None, :])
    for shift, mult, low in zip((30, 27, 31), (_MIX[1], _MIX[2], 1), _LOW_BITS):
        x = x ^ ((x >> shift) & low)
        if mult != 1:
            x = x * mult
    return (((x >> 40) & 0xFFFFFF).float() + 0.5) / float(1 << 24)
