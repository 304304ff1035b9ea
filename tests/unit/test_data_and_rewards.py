import json

import pytest
from transformers import AutoTokenizer

from miles_core.config import ArithmeticTaskConfig, DataConfig
from miles_core.data import PromptSource, read_prompts, sft_samples, write_arithmetic_task
from miles_core.rewards import dapo, dapo_normalize, exact_match, get_reward, last_boxed, math_boxed, math_equivalent
from miles_core.tiny import build_tokenizer

# Rows as they appear in the public files: slime's processed dapo-math-17k.jsonl (prompt +
# label) and the original BytedTsinghua-SIA/DAPO-Math-17k layout (reward_model.ground_truth).
DAPO_PROCESSED = {
    "prompt": [{"content": "Solve the following math problem step by step. The last line of your response "
                           "should be of the form Answer: $Answer (without quotes) where $Answer is the answer "
                           "to the problem.\n\nIn triangle $ABC$, $\\sin \\angle A = \\frac{4}{5}$ and "
                           "$\\angle A < 90^\\circ$. Let $D$ be a point outside triangle $ABC$ such that "
                           "$\\angle BAD = \\angle DAC$...\n\nRemember to put your answer on its own line after "
                           "\"Answer:\".", "role": "user"}],
    "label": "34",
}
DAPO_ORIGINAL = {
    "data_source": "math_dapo",
    "prompt": [{"content": "What is 6*7?", "role": "user"}],
    "ability": "MATH",
    "reward_model": {"ground_truth": "42", "style": "rule-lighteval/MATH_v2"},
    "extra_info": {"index": "9a9b6eb4-a1cb-49d1-8c1e-62eaf2f74079"},
}


def test_reader_loads_both_real_dapo_layouts(tmp_path, tiny_model_dir):
    path = tmp_path / "dapo.jsonl"
    path.write_text(json.dumps(DAPO_PROCESSED) + "\n\n" + json.dumps(DAPO_ORIGINAL) + "\n")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = read_prompts(path, DataConfig(), tokenizer)
    assert [p.label for p in prompts] == ["34", "42"]
    assert prompts[1].metadata["data_source"] == "math_dapo"
    rendered = tokenizer.decode(prompts[1].input_ids)
    assert rendered == "<|user|>What is 6*7?<|end|><|assistant|>"


def test_reader_rejects_rows_without_label_with_line_number(tmp_path, tiny_model_dir):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "hi"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: no 'label'"):
        read_prompts(path, DataConfig(), AutoTokenizer.from_pretrained(tiny_model_dir))


def test_reader_names_file_and_line_of_a_row_that_is_not_utf8(tmp_path, tiny_model_dir):
    path = tmp_path / "latin1.jsonl"
    good = json.dumps({"prompt": "1+1=", "label": "2"}).encode()
    path.write_bytes(good + b"\n" + good + b"\n" + b'{"prompt": "caf\xe9", "label": "2"}\n')
    with pytest.raises(ValueError, match=r"latin1.jsonl:3: not UTF-8 text .*convert the file"):
        read_prompts(path, DataConfig(), AutoTokenizer.from_pretrained(tiny_model_dir))


def test_reader_skips_overlong_prompts(tmp_path, tiny_model_dir):
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"prompt": "1+1=", "label": "2"}) + "\n" + json.dumps({"prompt": "9" * 50, "label": "9"}))
    prompts = read_prompts(path, DataConfig(max_prompt_tokens=10), AutoTokenizer.from_pretrained(tiny_model_dir))
    assert [p.label for p in prompts] == ["2"]


def test_builtin_task_is_disjoint_and_correct(tmp_path):
    train, held_out = write_arithmetic_task(ArithmeticTaskConfig(num_train=300, num_eval=50, max_operand=30), tmp_path)
    rows = [json.loads(line) for line in train.read_text().splitlines()]
    eval_rows = [json.loads(line) for line in held_out.read_text().splitlines()]
    assert len(rows) == 300 and len(eval_rows) == 50
    assert not {r["prompt"][0]["content"] for r in rows} & {r["prompt"][0]["content"] for r in eval_rows}
    for row in rows + eval_rows:
        a, b = row["prompt"][0]["content"].rstrip("=").split("+")
        assert int(row["label"]) == int(a) + int(b) and 0 <= int(a) <= 30 and 0 <= int(b) <= 30
    with pytest.raises(ValueError, match="lower num_train"):
        write_arithmetic_task(ArithmeticTaskConfig(num_train=100, num_eval=1, max_operand=5), tmp_path)


def test_column_addition_task_has_long_worked_solutions_that_the_reward_accepts(tmp_path):
    task = ArithmeticTaskConfig(kind="column_addition", digits=8, num_train=400, num_eval=100, seed=3)
    train, held_out = write_arithmetic_task(task, tmp_path)
    rows = [json.loads(line) for line in train.read_text().splitlines()]
    eval_rows = [json.loads(line) for line in held_out.read_text().splitlines()]
    assert len(rows) == 400 and len(eval_rows) == 100
    assert not {r["prompt"][0]["content"] for r in rows} & {r["prompt"][0]["content"] for r in eval_rows}
    tokenizer = build_tokenizer()
    lengths = []
    for row in rows + eval_rows:
        a, b = (int(x) for x in row["prompt"][0]["content"].rstrip("=").split("+"))
        assert 10_000_000 <= min(a, b) and max(a, b) <= 99_999_999 and row["label"] == str(a + b)
        assert dapo(row["solution"], row["label"]) == 1.0
        lengths.append(len(tokenizer(row["solution"], add_special_tokens=False)["input_ids"]))
    assert sum(lengths) / len(lengths) >= 100  # issue 39: real RL lengths
    # a wrong column shows in the answer, so the reward checks every step
    assert dapo(rows[0]["solution"].replace(f"Answer: {rows[0]['label']}", "Answer: 1"), rows[0]["label"]) == -1.0
    again, _ = write_arithmetic_task(task, tmp_path / "again")
    assert again.read_text() == train.read_text()


def test_column_addition_solution_carries():
    from miles_core.data import column_addition_solution

    assert column_addition_solution(95, 17) == "1: 5+7+0=12\n2: 9+1+1=11\nAnswer: 112"


def test_sft_trains_on_the_worked_solution_where_a_row_has_one(tmp_path):
    task = ArithmeticTaskConfig(kind="column_addition", digits=3, num_train=5, num_eval=1)
    train, _ = write_arithmetic_task(task, tmp_path)
    tokenizer = build_tokenizer()
    prompts = read_prompts(train, DataConfig(), tokenizer)
    sample = sft_samples(prompts, tokenizer)[0]
    assert tokenizer.decode(sample.response_ids) == prompts[0].metadata["solution"] + tokenizer.eos_token
    label_only = sft_samples(prompts, tokenizer, solution_key="absent")[0]
    assert tokenizer.decode(label_only.response_ids) == prompts[0].label + tokenizer.eos_token


def test_prompt_source_resumes_exactly(tmp_path, tiny_model_dir):
    prompts = list(range(10))
    source = PromptSource(prompts, seed=3)
    source.next_batch(7)
    state = source.state_dict()
    expected = source.next_batch(9)  # crosses an epoch boundary
    resumed = PromptSource(prompts, seed=3)
    resumed.load_state_dict(state)
    assert resumed.next_batch(9) == expected


def test_rewards():
    assert exact_match(" 46 ", "46") == 1.0
    assert exact_match("46.0", "46") == 1.0
    assert exact_match("47", "46") == 0.0
    assert exact_match("", "0") == 0.0
    assert last_boxed(r"so \boxed{\frac{1}{2}} and \boxed{7}") == "7"
    assert last_boxed(r"\boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert get_reward("exact_match") is exact_match
    assert get_reward("math") is math_equivalent
    assert get_reward("miles_core.rewards:dapo") is dapo
    with pytest.raises(ValueError, match="registered"):
        get_reward("nope")


# (response as models write it, label as dapo-math-17k stores it, expected DAPO reward)
DAPO_CASES = [
    ("Let me compute.\nAnswer: $34$", "34", 1.0),
    ("Answer: 34", "34", 1.0),
    ("Answer: \\boxed{34}", "34", 1.0),
    ("answer: 34", "34", 1.0),  # case-insensitive
    ("Answer:\n34", "34", 1.0),  # the value may start on the next line
    ("Answer: 1,000", "1000", 1.0),
    ("Answer: \\frac{1}{2}", "\\frac{1}{2}", 1.0),
    ("Answer: \\frac12", "\\frac{1}{2}", 1.0),
    ("Answer: x = 34", "34", 1.0),  # the part after the last '='
    ("Answer: 34 degrees", "34", 1.0),
    ("Answer: $34^\\circ$", "34", 1.0),
    ("Answer: 33\nAnswer: 34", "34", 1.0),  # the last answer line counts
    ("Answer: 35", "34", -1.0),
    ("The answer is \\boxed{34}", "34", -1.0),  # no 'Answer:' line
    ("Answer: 0.5", "\\frac{1}{2}", -1.0),  # DAPO compares strings, not values
    ("Answer: 34" + "x" * 300, "34", -1.0),  # outside the last 300 characters
    ("Answer: 34", "\\boxed{34}", 1.0),  # a boxed label is unwrapped too
]


@pytest.mark.parametrize("response,label,expected", DAPO_CASES)
def test_dapo_reward_follows_dapos_normalisation(response, label, expected):
    assert dapo(response, label) == expected


def test_dapo_normalize():
    assert dapo_normalize(" $1,000$ ") == "1000"
    assert dapo_normalize("\\text{(B)}") == "(B)"
    assert dapo_normalize("-1,000") == "-1,000"  # only all-digit numbers lose their commas


# (response, label, expected `math` reward): equivalence, not string equality
MATH_CASES = [
    ("Answer: $34$", "34", 1.0),
    ("so the result is \\boxed{34}", "34", 1.0),
    ("34", "34", 1.0),
    ("The answer is 34.", "34", 1.0),
    ("$\\frac{1}{2}$", "0.5", 1.0),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1.0),
    ("Answer: 0.5", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\dfrac{1}{2}}", "\\frac{1}{2}", 1.0),
    ("Answer: 1,000", "1000", 1.0),
    ("\\boxed{1+x^2}", "x^2+1", 1.0),
    ("\\boxed{3.14159265}", "\\pi", 1.0),
    ("Answer: 35", "34", 0.0),
    ("\\boxed{35}", "34", 0.0),
    ("first 34, then 35", "34", 0.0),  # the last expression is the answer
    ("no number here", "34", 0.0),
]


@pytest.mark.parametrize("response,label,expected", MATH_CASES)
def test_math_reward_is_equivalence(response, label, expected):
    assert math_equivalent(response, label) == expected


@pytest.mark.parametrize("response,label,expected", [
    ("thus \\boxed{34}", "34", 1.0),
    ("thus \\boxed{\\frac{2}{4}}", "0.5", 1.0),
    ("thus \\boxed{35}", "34", 0.0),
    ("34", "34", 0.0),  # no box
])
def test_math_boxed_needs_a_box_and_compares_values(response, label, expected):
    assert math_boxed(response, label) == expected


def test_math_reward_works_off_the_main_thread():
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:  # async loops score rollouts in a producer thread
        assert list(pool.map(math_equivalent, ["\\boxed{34}", "35"], ["34", "34"])) == [1.0, 0.0]
