"""miles_async.tasks.rewards: the dataset task's rewards on real strings, graded by the real math-verify
(GSM8K rationales, `\\boxed{}`, fractions against decimals, LaTeX, wrong and missing answers), the
string and regex rewards, a user's function loaded by name, and each bad name's one-line error."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from miles_async.tasks.rewards import (
    check_name,
    exact_reward,
    final_answer,
    gold_answer,
    is_async,
    math_reward,
    parses,
    reward_fn,
)

GSM8K_LABEL = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
               "altogether in April and May.\n#### 72")


@pytest.mark.parametrize(("completion", "label", "score"), [
    ("She sold 24 in May, so 48 + 24 = 72 in all.\n#### 72", GSM8K_LABEL, 1.0),
    ("48 + 24 = 72. The answer is 72.", GSM8K_LABEL, 1.0),  # no ####: the answer math-verify finds
    ("In May she sold 24, in all 71.\n#### 71", GSM8K_LABEL, 0.0),  # a wrong answer
    ("I am not sure how to solve this.", GSM8K_LABEL, 0.0),  # no answer
    ("48 + 24 = 72 ... wait, #### 70", GSM8K_LABEL, 0.0),  # the #### answer counts, not an earlier number
    ("So the probability is \\boxed{\\frac{3}{4}}.", "3/4", 1.0),
    ("So the probability is \\boxed{3/4}.", "0.75", 1.0),
    ("The answer is 0.75", "3/4", 1.0),
    ("The answer is $\\frac{1}{2}$", "0.5", 1.0),
    ("The answer is $\\frac{2}{3}$", "0.5", 0.0),
    ("$x = \\sqrt{2}$, so \\boxed{\\sqrt{2}}", "\\sqrt{2}", 1.0),
    ("The total is 1,000 apples.\n#### 1,000", "Some work.\n#### 1000", 1.0),
    ("The answer is 72<|im_end|>", "72", 1.0),
])
def test_math_reward_compares_answers_with_math_verify(completion: str, label: str, score: float) -> None:
    assert math_reward(completion, label) == score


def test_the_label_and_the_completion_answers_are_read_as_gsm8k_writes_them() -> None:
    assert gold_answer(GSM8K_LABEL) == "72" and gold_answer(" 3/4 ") == "3/4"
    assert final_answer("work\n#### 72\nThe answer is 72.") == "72"
    assert final_answer("no marker: 5") == "no marker: 5"
    assert parses(GSM8K_LABEL) and parses("\\frac{1}{2}") and not parses("no number here")


def test_math_reward_works_off_the_main_thread() -> None:
    """math-verify's default timeout is signal.alarm, main thread only: the task grades in worker threads."""
    cases = [("\\boxed{3/4}", "0.75"), ("#### 71", GSM8K_LABEL), ("#### 72", GSM8K_LABEL)] * 4
    with ThreadPoolExecutor(4) as pool:
        scores = list(pool.map(lambda case: math_reward(*case), cases))
    assert scores == [1.0, 0.0, 1.0] * 4
    assert threading.current_thread() is threading.main_thread()


@pytest.mark.parametrize(("completion", "label", "score"), [
    ("  Paris. ", "paris", 1.0),
    ("Paris  is the capital", "Paris is the capital.", 1.0),
    ("Paris is", "Paris", 0.0),
    ("72", "work\n#### 72", 1.0),  # a GSM8K label's answer is what follows ####
])
def test_exact_reward_compares_normalised_strings(completion: str, label: str, score: float) -> None:
    assert exact_reward(completion, label) == score


def test_regex_reward_compares_the_first_group_or_the_match() -> None:
    grouped = reward_fn(r"regex:answer is (-?\d+)")
    assert grouped("so the answer is 42.", "42") == 1.0
    assert grouped("so the answer is 41.", "42") == 0.0
    assert grouped("no answer here", "42") == 0.0
    whole = reward_fn(r"regex:\d+")
    assert whole("I count 7 cats, then 8", "7") == 1.0  # the first match


@pytest.mark.parametrize(("name", "message"), [
    ("mth", "'mth' is not a reward \\(did you mean 'math'\\?\\)"),
    ("exactt", "did you mean 'exact'"),
    ("nothing like it", "is not a reward: use \"math\", \"exact\", \"regex:PATTERN\""),
    ("regex:(", "regex '\\(' does not compile: missing \\), unterminated subpattern"),
    ("regex:", "has no pattern"),
])
def test_bad_reward_names_are_one_line(name: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as error:
        reward_fn(name)
    assert "\n" not in str(error.value)


def test_a_users_function_is_loaded_by_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_rewards.py").write_text(
        "def length_ok(completion, label):\n    return len(completion) <= int(label)\n\n"
        "async def says_hi(completion: str, label: str) -> float:\n    return float('hi' in completion)\n\n"
        "def one_arg(completion):\n    return 1.0\n\nNOT_A_FUNCTION = 3\n")
    (tmp_path / "broken_rewards.py").write_text("raise RuntimeError('no GPU here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    plain, coroutine = reward_fn("my_rewards:length_ok"), reward_fn("my_rewards:says_hi")
    assert plain("abc", "3") is True and not is_async(plain)
    assert is_async(coroutine) and asyncio.run(coroutine("oh hi", "")) == 1.0
    check_name("my_rewards:length_ok")  # the form alone: nothing imported
    for name, message in [("my_rewards:missing", "my_rewards has no 'missing'"),
                          ("no_such_module:fn", "cannot import 'no_such_module'"),
                          ("broken_rewards:fn", "importing broken_rewards failed: RuntimeError: no GPU here"),
                          ("my_rewards:one_arg", "must take \\(completion: str, label: str\\)"),
                          ("my_rewards:NOT_A_FUNCTION", "is a int, not a function")]:
        with pytest.raises(ValueError, match=message):
            reward_fn(name)
