"""Writes the toy task of the GRPO example (run from the repository root; the
files are committed, so this is only needed to change them):

- `examples/data/arithmetic_sft.jsonl`: 6000 `{"prompt", "completion"}` rows,
  sums of two numbers below 100 (`"37+58="` -> `"95"`), for the SFT warm-up;
- `examples/data/arithmetic_prompts.jsonl`: 2000 other `{"prompt", "answer"}`
  rows, the prompts GRPO samples completions for and the answers its
  `exact_answer` reward checks (enough that 200 steps of 16 do not learn them
  by heart, so the held-out reward can rise);
- `examples/data/arithmetic_eval.jsonl`: 64 more, held out: GRPO's `data.eval`
  (completed greedily at each evaluation and scored with the same reward).

Deterministic: the same files on every machine.
"""

import json
import random
from pathlib import Path


HERE = Path(__file__).parent


def problems(seed: int, n: int, skip: set[str]) -> list[tuple[str, str]]:
    rng, out = random.Random(seed), []
    while len(out) < n:
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        prompt = f"{a}+{b}="
        if prompt not in skip:
            skip.add(prompt)
            out.append((prompt, str(a + b)))
    return out


def write(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def main() -> None:
    seen: set[str] = set()
    sft = problems(0, 6000, seen)
    prompts = problems(1, 2000, seen)
    held_out = problems(2, 64, seen)
    write(
        HERE / "arithmetic_sft.jsonl", [{"prompt": p, "completion": c} for p, c in sft]
    )
    write(
        HERE / "arithmetic_prompts.jsonl",
        [{"prompt": p, "answer": a} for p, a in prompts],
    )
    write(
        HERE / "arithmetic_eval.jsonl",
        [{"prompt": p, "answer": a} for p, a in held_out],
    )


if __name__ == "__main__":
    main()
