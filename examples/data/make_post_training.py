"""Writes the small post-training data sets the example configs use (run from the
repository root; the files are committed, so this is only needed to change them):

- `examples/data/sft.jsonl`: 400 chats, `{"messages": [...]}`, a system prompt on
  some; the assistant answers sums and differences of small numbers in words.
- `examples/data/preference.jsonl`: 400 pairs, `{"prompt", "chosen", "rejected"}`
  as message lists (TRL's conversational form: the prompt is the conversation so
  far, chosen and rejected the assistant's replies): the chosen answer is right;
  the rejected one dodges the question, or (one in four) is off by one or two.
- `examples/data/*_eval.jsonl`: 64 held-out rows of each.

Deterministic: the same files on every machine.
"""

import json
import random
from pathlib import Path


HERE = Path(__file__).parent
SYSTEM = "You are a careful calculator. Answer with the result only."


def question(rng: random.Random) -> tuple[str, int]:
    a, b = rng.randint(0, 49), rng.randint(0, 49)
    if rng.random() < 0.5:
        return f"What is {a} plus {b}?", a + b
    a, b = max(a, b), min(a, b)
    return f"What is {a} minus {b}?", a - b


def answer(value: int) -> str:
    return f"The answer is {value}."


def chats(rng: random.Random, n: int) -> list[dict]:
    rows = []
    for _ in range(n):
        text, value = question(rng)
        messages = [{"role": "user", "content": text}]
        if rng.random() < 0.3:
            messages.insert(0, {"role": "system", "content": SYSTEM})
        messages.append({"role": "assistant", "content": answer(value)})
        rows.append({"messages": messages})
    return rows


DODGES = (
    "I would rather not say.",
    "Work it out yourself.",
    "That is not my problem.",
    "Ask someone else.",
)


def pairs(rng: random.Random, n: int) -> list[dict]:
    rows = []
    for _ in range(n):
        text, value = question(rng)
        if rng.random() < 0.25:
            wrong = answer(value + rng.choice([-2, -1, 1, 2]))
        else:
            wrong = rng.choice(DODGES)
        reply = lambda content: [{"role": "assistant", "content": content}]  # noqa: E731
        rows.append(
            {
                "prompt": [{"role": "user", "content": text}],
                "chosen": reply(answer(value)),
                "rejected": reply(wrong),
            }
        )
    return rows


def write(name: str, rows: list[dict]) -> None:
    with open(HERE / name, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def main() -> None:
    rng = random.Random(0)
    write("sft.jsonl", chats(rng, 400))
    write("sft_eval.jsonl", chats(rng, 64))
    write("preference.jsonl", pairs(rng, 400))
    write("preference_eval.jsonl", pairs(rng, 64))


if __name__ == "__main__":
    main()
