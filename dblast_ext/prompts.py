"""A prompt as both the training-data generator and the evaluation read it: the user turns of
one conversation, and the chat messages at a given turn. Loading prompts from benchmarks
or files is `eval.datasets`; the built-in demo prompts (`DEMO_PROMPTS`) are here, where the demo
and the vLLM plugin's schedule measurement both read them."""
from dataclasses import dataclass
from typing import List, Optional, Sequence


@dataclass
class Prompt:
    """One prompt: the user turns of a single conversation."""

    dataset: str          # "gsm8k", "math500", "humaneval", "mtbench", or the user file's stem
    prompt_id: str        # stable id unique within the dataset
    turns: List[str]      # user turns; two for MT-Bench, else one
    category: Optional[str] = None  # MT-Bench category, MATH subject, or None


def chat_messages(prompt: Prompt, turn: int = 0,
                  previous_answers: Sequence[str] = ()) -> List[dict]:
    """Messages for the chat template at user turn `turn`.

    User turns 0..turn, each of the first `turn` followed by the model's answer to it,
    so the last message is always the user turn being asked.
    """
    if not 0 <= turn < len(prompt.turns):
        raise ValueError(f"{prompt.dataset}/{prompt.prompt_id} has {len(prompt.turns)} "
                         f"turn(s); turn {turn} is out of range")
    if isinstance(previous_answers, str) or len(previous_answers) != turn:
        got = "a string" if isinstance(previous_answers, str) else f"{len(previous_answers)}"
        raise ValueError(f"turn {turn} needs exactly {turn} previous answer(s), got {got}")
    messages = []
    for t in range(turn + 1):
        messages.append({"role": "user", "content": prompt.turns[t]})
        if t < turn:
            messages.append({"role": "assistant", "content": previous_answers[t]})
    return messages


# the prompts `dblast demo` answers, and those vLLM's batch-size schedule is measured on
DEMO_PROMPTS = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "What is the sum of the first 20 positive odd numbers?",
    "Give me three tips for staying focused while studying.",
)
