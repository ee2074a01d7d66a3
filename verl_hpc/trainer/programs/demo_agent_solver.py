"""The agent of `make demo-agent`: a two-step arithmetic solver written against the `openai` client
only. It imports nothing from this project and would run unchanged against any OpenAI-compatible
server; the demo trains the policy behind the job's endpoint through it (docs/agents.md).

    solve(row, client_config) -> reward

1. asks the model for a draft answer to the row's question (a completion of "3+4=");
2. runs a tool of its own on the draft: `check`, which reads the first integer in it;
3. asks again with its history truncated back to the question (the draft and the tool's note
   dropped, as agents that keep their context short do), and takes that second answer if it is a
   number, else the draft's;
4. returns 1.0 when the answer equals the row's ground truth, else 0.0.
The two calls do not extend one another token for token, so each run is two training sequences of
its prompt's group (a split), both with the run's reward.
"""
from __future__ import annotations

import re

import openai

_INT = re.compile(r"-?\d+")


def check(text: str):
    """The agent's own tool: the first integer in a model answer, or None."""
    found = _INT.search(text or "")
    return int(found.group()) if found else None


def solve(row, client_config):
    client = openai.OpenAI(base_url=client_config["base_url"], api_key=client_config["api_key"],
                           max_retries=0, timeout=client_config.get("timeout", 60))
    question = row["prompt"]
    history = [question]
    draft = client.completions.create(model=client_config["model"], prompt=question, max_tokens=4).choices[0].text
    note = check(draft)
    history += [draft, f"[check: {note}]"]
    second = client.completions.create(model=client_config["model"], prompt=history[0],  # truncated
                                       max_tokens=4).choices[0].text
    answer = check(second)
    if answer is None:
        answer = note
    return 1.0 if answer is not None and str(answer) == str(row["ground_truth"]).strip() else 0.0
