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


# ---- environments with a defect of each kind (tests/unit/rollout/test_environment.py)
class NeedsSize:
    def __init__(self, size):
        self.size = size

    def reset(self, row):
        pass

    def step(self, turn_text):
        return None, 0.0, True


class StepTakesNothing(NeedsSize):
    def __init__(self):
        pass

    def step(self):
        return None, 0.0, True


class Behaves:
    """reset(row) keeps the row; step answers per what the turn asks for: 'raise', 'exit',
    'interrupt', 'shape', or a reward to return (the text after 'reward ')."""

    def reset(self, row):
        if row.get("reset") == "raise":
            raise KeyError("target")
        if row.get("reset") == "exit":
            raise SystemExit(0)
        self.row = row

    def step(self, turn_text):
        if turn_text == "raise":
            raise ValueError("cannot read the turn")
        if turn_text == "exit":
            raise SystemExit(0)
        if turn_text == "interrupt":
            raise KeyboardInterrupt
        if turn_text == "shape":
            return "only two", 1.0
        if turn_text == "ctrl-c":  # the user's Ctrl-C arrives while the step runs
            import os
            import signal
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.3)
        rewards = {"text": "high", "nan": float("nan"), "inf": float("inf"), "true": True, "huge": 10 ** 400,
                   "none": None, "half": 0.5}
        return "go on", rewards.get(turn_text.partition("reward ")[2], 0.0), False


class BuiltBadly(Behaves):
    def __init__(self):
        raise RuntimeError("no licence server")
