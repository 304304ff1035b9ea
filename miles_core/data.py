"""Prompt datasets (DAPO-style jsonl), the built-in arithmetic tasks, and a resumable source."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from miles_core.config import ArithmeticTaskConfig, DataConfig
from miles_core.types import Prompt, Sample


def column_addition_solution(a: int, b: int) -> str:
    """The worked scratchpad of a+b: one line per column from the right, `i: x+y+carry=s`,
    then DAPO's answer line. Every step is a one-digit sum, so a small model can learn it,
    and any wrong step shows in the answer."""
    width = max(len(str(a)), len(str(b)))
    xs, ys = str(a).zfill(width)[::-1], str(b).zfill(width)[::-1]
    lines, carry = [], 0
    for i, (x, y) in enumerate(zip(xs, ys), start=1):
        total = int(x) + int(y) + carry
        lines.append(f"{i}: {x}+{y}+{carry}={total}")
        carry = total // 10
    return "\n".join([*lines, f"Answer: {a + b}"])


def _arithmetic_pairs(task: ArithmeticTaskConfig, rng: random.Random) -> list[tuple[int, int]]:
    needed = task.num_train + task.num_eval  # <= distinct_problems(): ArithmeticTaskConfig validates it
    if task.kind == "addition":
        pairs = [(a, b) for a in range(task.max_operand + 1) for b in range(task.max_operand + 1)]
        rng.shuffle(pairs)
        return pairs[:needed]
    low, high = 10 ** (task.digits - 1), 10 ** task.digits - 1
    drawn: dict[tuple[int, int], None] = {}  # insertion-ordered: the draw order is the split
    while len(drawn) < needed:
        drawn[(rng.randint(low, high), rng.randint(low, high))] = None
    return list(drawn)


def _arithmetic_row(task: ArithmeticTaskConfig, a: int, b: int) -> dict[str, Any]:
    row: dict[str, Any] = {"prompt": [{"role": "user", "content": f"{a}+{b}="}], "label": str(a + b)}
    if task.kind == "column_addition":
        row["solution"] = column_addition_solution(a, b)
    return row


def write_arithmetic_task(task: ArithmeticTaskConfig, out_dir: str | Path) -> tuple[Path, Path]:
    """Write train/eval jsonl files of the built-in task (task.kind), in the dapo-math-17k row
    layout: chat-message prompt, label, and for column_addition a worked `solution`."""
    pairs = _arithmetic_pairs(task, random.Random(task.seed))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    splits = {"train": pairs[: task.num_train], "eval": pairs[task.num_train:]}
    paths = []
    for split, rows in splits.items():
        path = out_dir / f"{split}.jsonl"
        with path.open("w") as fh:
            for a, b in rows:
                fh.write(json.dumps(_arithmetic_row(task, a, b)) + "\n")
        paths.append(path)
    return paths[0], paths[1]


def _label_of(row: dict[str, Any], label_key: str) -> str:
    if label_key in row:
        return str(row[label_key])
    ground_truth = (row.get("reward_model") or {}).get("ground_truth")
    if ground_truth is not None:  # the original DAPO-Math-17k layout
        return str(ground_truth)
    raise KeyError(label_key)


def row_problem(line: str, prompt_key: str, label_key: str) -> str | None:
    """What is wrong with one jsonl row (None when nothing): a JSON object whose prompt is a
    string or a list of {role, content} messages with string content, and whose label is a
    string or a number (or reward_model.ground_truth, the DAPO-Math layout)."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        return f"not JSON ({exc.msg})"
    if not isinstance(row, dict):
        return f"expected a JSON object, got {type(row).__name__}"
    if prompt_key not in row:
        return f"no '{prompt_key}' field"
    problem = _prompt_problem(row[prompt_key])
    if problem:
        return f"'{prompt_key}': {problem}"
    label = row[label_key] if label_key in row else (row.get("reward_model") or {}).get("ground_truth")
    if label is None:
        return f"no '{label_key}' (or reward_model.ground_truth), or it is null"
    if isinstance(label, bool) or not isinstance(label, (str, int, float)):
        return f"'{label_key}' must be a string or a number, got {type(label).__name__}"
    return None


def _prompt_problem(prompt: Any) -> str | None:
    if isinstance(prompt, str):
        return None if prompt.strip() else "empty"
    if not isinstance(prompt, list) or not prompt:
        return f"expected a string or a non-empty list of messages, got {type(prompt).__name__}"
    for i, message in enumerate(prompt):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            return f"message {i} needs a string 'content' (and a 'role')"
        if not isinstance(message.get("role"), str):
            return f"message {i} needs a string 'role'"
    return None


def jsonl_lines(path: str | Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of each non-blank line of a jsonl file, decoded as UTF-8 one line at
    a time: a text-mode read decodes in blocks, and its UnicodeDecodeError names neither the
    file nor the line. A line that is not UTF-8 raises a ValueError that names both."""
    with Path(path).open("rb") as fh:
        for line_no, raw in enumerate(fh, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ValueError(
                    f"{path}:{line_no}: not UTF-8 text ({exc.reason} at byte {exc.start + 1} of the line): "
                    "data files are read as UTF-8; convert the file (e.g. `iconv -f latin1 -t utf-8`)") from None
            if line.strip():
                yield line_no, line


def read_prompts(path: str | Path, data: DataConfig, tokenizer) -> list[Prompt]:
    """Read a jsonl of prompts (chat messages or text) + labels and tokenise them."""
    prompts, skipped_long = [], 0
    for line_no, line in jsonl_lines(path):
        problem = row_problem(line, data.prompt_key, data.label_key)
        if problem is not None:
            raise ValueError(f"{path}:{line_no}: {problem}")
        row = json.loads(line)
        messages, label = row[data.prompt_key], _label_of(row, data.label_key)
        if isinstance(messages, list) and data.apply_chat_template:
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            ids = list(ids if isinstance(ids, list) else ids["input_ids"])
        else:
            text = messages if isinstance(messages, str) else "".join(m["content"] for m in messages)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) > data.max_prompt_tokens:
            skipped_long += 1
            continue
        extra = {k: v for k, v in row.items() if k not in (data.prompt_key, data.label_key)}
        budget = row.get(data.max_new_tokens_key) if data.max_new_tokens_key else None
        try:
            prompts.append(Prompt(len(prompts), messages, label, ids, extra, max_new_tokens=budget))
        except ValueError as exc:
            raise ValueError(f"{path}:{line_no}: row key {data.max_new_tokens_key!r}: {exc}") from None
    if not prompts:
        raise ValueError(f"{path}: no usable prompts ({skipped_long} longer than data.max_prompt_tokens)")
    return prompts


class PromptSource:
    """Endless, seeded, resumable stream of prompt batches: state is (epoch, offset)."""

    def __init__(self, prompts: list[Prompt], seed: int):
        self.prompts, self.seed = prompts, seed
        self.epoch, self.offset = 0, 0
        self._order = self._shuffled(0)

    def _shuffled(self, epoch: int) -> list[int]:
        order = list(range(len(self.prompts)))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next_batch(self, batch_size: int) -> list[Prompt]:
        batch = []
        while len(batch) < batch_size:
            if self.offset >= len(self._order):
                self.epoch, self.offset = self.epoch + 1, 0
                self._order = self._shuffled(self.epoch)
            batch.append(self.prompts[self._order[self.offset]])
            self.offset += 1
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
        self._order = self._shuffled(self.epoch)


def _conversation_sample(prompt: Prompt, tokenizer) -> Sample:
    """Multi-turn SFT: the loss covers exactly the tokens the chat template adds for
    assistant turns (found by rendering growing prefixes of the conversation)."""
    messages = prompt.messages
    ids, trainable = [], []
    for end in range(1, len(messages) + 1):
        rendered = tokenizer.apply_chat_template(messages[:end], tokenize=True)
        rendered = list(rendered if isinstance(rendered, list) else rendered["input_ids"])
        added = rendered[len(ids):]
        ids, trainable = rendered, trainable + [float(messages[end - 1]["role"] == "assistant")] * len(added)
    first = trainable.index(1.0) if 1.0 in trainable else len(ids)
    return Sample(prompt.index, ids[:first], ids[first:], prompt.label, loss_mask=trainable[first:])


def sft_samples(prompts: list[Prompt], tokenizer, solution_key: str = "solution") -> list[Sample]:
    """Supervised samples: prompt + target + eos (loss on target and eos), the target being the
    row's worked solution (`solution_key`) where it has one, else its label; for conversation
    rows whose messages include assistant turns, the assistant tokens of the conversation."""
    eos = tokenizer.eos_token_id
    samples = []
    for p in prompts:
        if isinstance(p.messages, list) and any(m.get("role") == "assistant" for m in p.messages):
            samples.append(_conversation_sample(p, tokenizer))
        else:
            target = str(p.metadata.get(solution_key, p.label))
            target_ids = tokenizer(target, add_special_tokens=False)["input_ids"]
            samples.append(Sample(p.index, p.input_ids, target_ids + [eos], p.label))
    return samples
