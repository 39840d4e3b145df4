"""Grade-school word problems in GSM8K's format, written from a seed: the data of the CPU dataset recipe.

Each row is GSM8K's: `question`, and `answer`, a short rationale whose steps carry GSM8K's calculator
annotations, ending in `#### N`:

    {"question": "Mia has 14 stickers. She buys 9 more. How many stickers does Mia have now?",
     "answer": "Mia has 14 + 9 = <<14+9=23>>23 stickers now.\\n#### 23"}

The problems come from `TEMPLATES`, one or two arithmetic steps each (add, take away, multiply,
share equally, and a step of each after the other), with names, objects and numbers drawn from a
`random.Random(seed)`: the same seed writes the same files, byte for byte. A question is in one
file only (the test file is drawn first; a train question that repeats one is drawn again).

Why these numbers (measured greedy with SmolLM2-135M-Instruct, the embedded engine, through the
chat template, answers up to 64 tokens, graded by `rewards.math_reward`: the number after `####`,
else the last number the model writes): with operands up to 40 the model was right on 0.12 of
120 test problems (it adds two-digit numbers wrongly: `25 + 17 = 32`); with the small operands
here, 0.23 of 60 (add 0.5, take away 0.3, multiply 0.4, share 0.1, the two-step ones 0.1 and 0.0)
in bf16, 0.31 of 32 in fp32. Right sometimes, not always: GRPO's groups hold both outcomes. The
model's wrong answers are as often a rambling tail whose last number is not the answer (`... So,
Nina has 16 + 8`) as a wrong sum, which is what a run teaches it first.

Try it:
    python -m miles_async.tasks.word_problems --train recipes/data/word-problems-train.jsonl \\
        --test recipes/data/word-problems-test.jsonl          # the shipped files (the defaults)
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable, Sequence
from pathlib import Path

NAMES = ("Mia", "Leo", "Ava", "Sam", "Zoe", "Max", "Ivy", "Ben", "Lily", "Noah", "Emma", "Omar", "Nina", "Tom",
         "Ella", "Jack", "Rosa", "Kai", "Lena", "Ravi")
# (the things, plural; what they come in, plural)
THINGS = (("apples", "bags"), ("stickers", "packs"), ("marbles", "jars"), ("pencils", "boxes"), ("cookies", "trays"),
          ("cards", "decks"), ("shells", "buckets"), ("books", "crates"), ("eggs", "cartons"), ("beads", "strings"))
Row = dict[str, str]


def _who(rng: random.Random) -> tuple[str, str]:
    """A name and its pronoun (the names are written so that a coin decides: it keeps rows short)."""
    name = rng.choice(NAMES)
    return name, ("She" if name in {"Mia", "Ava", "Zoe", "Ivy", "Lily", "Emma", "Nina", "Ella", "Rosa", "Lena"}
                  else "He")


def _step(a: int, op: str, b: int) -> tuple[str, int]:
    """`a op b = <<a op b=c>>c` as GSM8K writes a calculator step, and c."""
    value = {"+": a + b, "-": a - b, "*": a * b, "/": a // b}[op]
    return f"{a} {op} {b} = <<{a}{op}{b}={value}>>{value}", value


def add(rng: random.Random) -> Row:
    name, she = _who(rng)
    things, _ = rng.choice(THINGS)
    a, b = rng.randint(3, 20), rng.randint(2, 12)
    work, total = _step(a, "+", b)
    return {"question": f"{name} has {a} {things}. {she} buys {b} more. How many {things} does {name} have now?",
            "answer": f"{name} has {work} {things} now.\n#### {total}"}


def take_away(rng: random.Random) -> Row:
    name, _ = _who(rng)
    things, _ = rng.choice(THINGS)
    b = rng.randint(2, 9)
    a = b + rng.randint(2, 15)
    work, left = _step(a, "-", b)
    return {"question": f"{name} had {a} {things} and gave {b} of them to a friend. How many {things} does {name} "
                        "have left?",
            "answer": f"{name} has {work} {things} left.\n#### {left}"}


def multiply(rng: random.Random) -> Row:
    name, she = _who(rng)
    things, container = rng.choice(THINGS)
    a, b = rng.randint(2, 5), rng.randint(2, 6)
    work, total = _step(a, "*", b)
    return {"question": f"{name} buys {a} {container} of {things}. Each one has {b} {things}. How many "
                        f"{things} does {she.lower()} buy?",
            "answer": f"{name} buys {work} {things}.\n#### {total}"}


def share(rng: random.Random) -> Row:
    name, _ = _who(rng)
    things, _ = rng.choice(THINGS)
    each, friends = rng.randint(2, 6), rng.randint(2, 5)
    work, _ = _step(each * friends, "/", friends)
    return {"question": f"{name} shares {each * friends} {things} equally among {friends} friends. How many {things} "
                        "does each friend get?",
            "answer": f"Each friend gets {work} {things}.\n#### {each}"}


def add_then_take(rng: random.Random) -> Row:
    name, she = _who(rng)
    things, _ = rng.choice(THINGS)
    a, b = rng.randint(3, 12), rng.randint(2, 9)
    c = rng.randint(2, a + b - 1)
    first, total = _step(a, "+", b)
    second, left = _step(total, "-", c)
    return {"question": f"{name} has {a} {things}. {she} buys {b} more and then gives {c} to a friend. How many "
                        f"{things} does {name} have now?",
            "answer": f"After buying, {name} has {first} {things}.\nAfter giving some away, {she.lower()} has "
                      f"{second} {things}.\n#### {left}"}


def multiply_then_add(rng: random.Random) -> Row:
    name, she = _who(rng)
    things, container = rng.choice(THINGS)
    a, b, c = rng.randint(2, 4), rng.randint(2, 5), rng.randint(1, 9)
    first, bought = _step(a, "*", b)
    second, total = _step(bought, "+", c)
    return {"question": f"{name} has {c} {things}. {she} buys {a} {container} with {b} {things} in each. How many "
                        f"{things} does {name} have now?",
            "answer": f"The {container} hold {first} {things}.\n{name} has {second} {things} now.\n#### {total}"}


TEMPLATES: tuple[Callable[[random.Random], Row], ...] = (add, take_away, multiply, share, add_then_take,
                                                          multiply_then_add)


def problems(rng: random.Random, count: int, *, exclude: frozenset[str] = frozenset(),
             templates: Sequence[Callable[[random.Random], Row]] = TEMPLATES) -> list[Row]:
    """`count` distinct problems, the templates taken in turn (so each has its share), none whose
    question is in `exclude`."""
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    rows: list[Row] = []
    seen = set(exclude)
    attempts = 0
    while len(rows) < count:
        attempts += 1
        if attempts > 100 * (count + 10):
            raise ValueError(f"cannot draw {count} distinct problems from these templates (got {len(rows)})")
        row = templates[len(rows) % len(templates)](rng)
        if row["question"] not in seen:
            seen.add(row["question"])
            rows.append(row)
    return rows


def write_jsonl(path: Path, rows: Sequence[Row]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")


def generate(seed: int, num_train: int, num_test: int) -> tuple[list[Row], list[Row]]:
    """(train, test) rows for `seed`: disjoint questions, deterministic."""
    rng = random.Random(f"word-problems:{seed}")
    test = problems(rng, num_test)
    train = problems(rng, num_train, exclude=frozenset(row["question"] for row in test))
    return train, test


def main(argv: Sequence[str] | None = None) -> None:
    data = Path("recipes/data")  # from the repository's root, where the shipped files live
    parser = argparse.ArgumentParser(prog="python -m miles_async.tasks.word_problems",
                                     description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--train", type=Path, default=data / "word-problems-train.jsonl")
    parser.add_argument("--test", type=Path, default=data / "word-problems-test.jsonl")
    parser.add_argument("--num-train", type=int, default=1200)
    parser.add_argument("--num-test", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    train, test = generate(args.seed, args.num_train, args.num_test)
    write_jsonl(args.train, train)
    write_jsonl(args.test, test)
    print(f"wrote {len(train)} problems to {args.train} and {len(test)} to {args.test}")


if __name__ == "__main__":
    main()
