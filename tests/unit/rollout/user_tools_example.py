"""User tools and an environment for tests/unit/rollout/test_tools.py, named the way a job's
config names them ('user_tools_example:word_count')."""
import time
from typing import Optional


def word_count(text: str) -> str:
    """Count the words of a text.

    Args:
        text: The text whose words are counted.
    """
    return str(len(text.split()))


def nap(seconds: float) -> int:
    """Sleep, then return how long.

    Args:
        seconds: How long to sleep.
    """
    time.sleep(seconds)
    return seconds


def undocumented(text):
    return text


class Guess:
    """Guess the number 7: each turn is a guess, the observation says higher or lower."""

    def reset(self, row: dict) -> Optional[str]:
        return "Guess a number from 1 to 10."

    def step(self, turn_text: str):
        guess = int(turn_text.strip())
        return ("right" if guess == 7 else "higher" if guess < 7 else "lower"), float(guess == 7), guess == 7


class NoStep:
    def reset(self, row):
        return None
