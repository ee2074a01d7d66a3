"""Episodes token in, token out: 1,000 episodes of a scripted stub policy through EpisodeRunner.

The stub engine writes its turns with a NON-canonical tokenization (one token per character where
BPE would merge), so any decode/encode round trip of the model's turns would change the ids: the
trained ids must be exactly the stub's tokens, then the template and tool-output tokens, in turn.
The expected template tokens are written out here for the tiny ChatML template (not derived the
way TurnCodec derives them).
"""
import random
import re
import time

import pytest

from verl_hpc.rollout.episodes.chat_turns import TurnCodec
from verl_hpc.rollout.episodes.runner import EpisodeRunner, Reply
from verl_hpc.rollout.result import RolloutResult
from verl_hpc.rollout.sampling import default_spec

CALL = re.compile(r'<tool_call>\{"name": "mul", "arguments": \{"a": (\d+), "b": (\d+)\}\}</tool_call>$')


@pytest.fixture(scope="module")
def tok():
    from verl_hpc.models.tiny import train_tokenizer

    return train_tokenizer()


def char_ids(tok, text):
    """Token ids of `text`, one token per character (never what BPE would give for digits)."""
    return [i for ch in text for i in tok(ch, add_special_tokens=False)["input_ids"]]


class StubEngine:
    """generate() as a RolloutEngine: episode (i, j) follows a plan drawn from Random(i, j); its turn
    number is read from the tool turns already in the prompt. Records what it emitted per episode."""

    def __init__(self, tok, prompts_text):
        self.tok, self.prompts_text = tok, prompts_text
        self.emitted = {}  # (i, j) -> [ids of turn 0, ids of turn 1, ...]
        self.eos = tok.eos_token_id

    def plan(self, i, j):
        rng = random.Random(i * 7919 + j)
        steps = [rng.choice(["call", "call", "bad", "answer", "ramble"]) for _ in range(6)]
        return rng, steps

    def turn_ids(self, i, j, turn):
        rng, steps = self.plan(i, j)
        for _ in range(turn):
            rng.random()
        kind = steps[turn]
        head = f"[{j}]" if turn == 0 else ""
        if kind == "call":
            a, b = rng.randint(10, 99999), rng.randint(10, 99999)
            text = head + f'<tool_call>{{"name": "mul", "arguments": {{"a": {a}, "b": {b}}}}}</tool_call>'
            return char_ids(self.tok, text), "stop"
        if kind == "bad":
            return char_ids(self.tok, head + '<tool_call>{"name": mul</tool_call>'), "stop"
        if kind == "answer":
            return char_ids(self.tok, head + f"the answer is {rng.randint(0, 10**6)}") + [self.eos], "stop"
        return char_ids(self.tok, head + "so " * 60), "length"

    def generate(self, prompts, spec, room=0):
        rows = dict(prompt_index=[], sample_index=[], response_ids=[], logprobs=[], finish_reason=[])
        for k, p in enumerate(prompts):
            text = self.tok.decode(p, skip_special_tokens=False)
            i = int(re.search(r"Q(\d+)\?", text).group(1))
            turn = text.count("<|im_start|>tool")
            for s in range(spec.n):
                j = s if turn == 0 else int(re.search(r"assistant\n\[(\d+)\]", text).group(1))
                ids, reason = self.turn_ids(i, j, turn)
                if len(ids) > spec.max_tokens:
                    ids, reason = ids[:spec.max_tokens], "length"
                self.emitted.setdefault((i, j), []).append(ids)
                rows["prompt_index"].append(k)
                rows["sample_index"].append(s)
                rows["response_ids"].append(ids)
                rows["logprobs"].append([-0.5] * len(ids))
                rows["finish_reason"].append(reason)
        return RolloutResult(prompts=[list(p) for p in prompts], **rows)


class MulTools:
    """A responder answering `mul` calls with the product, malformed ones with an error."""
    role, stop = "tool", ("</tool_call>",)

    def __init__(self, delay_s=0.0):
        self.delay_s, self.seen = delay_s, {}

    def start(self, rows):
        self.rows = rows

    def respond(self, turns):
        time.sleep(self.delay_s)
        out = []
        for t in turns:
            if "<tool_call>" not in t.text:
                out.append(Reply([], done=True))
                continue
            m = CALL.search(t.text)
            obs = str(int(m.group(1)) * int(m.group(2))) if m else "error: malformed tool call"
            self.seen.setdefault(t.episode, []).append(obs)
            out.append(Reply([obs], calls=1, errors=0 if m else 1, seconds=[0.001]))
        return out

    def close(self):
        pass


def template_ids(tok, obs):
    return tok("<|im_end|>\n" + f"<|im_start|>tool\n{obs}<|im_end|>\n" + "<|im_start|>assistant\n",
               add_special_tokens=False)["input_ids"]


def run(tok, n_prompts, n, *, max_turns, budget, turn_tokens, delay_s=0.0, timeout_s=0.0):
    texts = [f"Q{i}? multiply" for i in range(n_prompts)]
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                           add_generation_prompt=True), add_special_tokens=False)["input_ids"]
               for t in texts]
    engine, tools = StubEngine(tok, texts), MulTools(delay_s)
    runner = EpisodeRunner(engine, TurnCodec(tok), tools, max_turns=max_turns, budget=budget, timeout_s=timeout_s)
    spec = default_spec(n=n, max_tokens=turn_tokens, stop=())
    return runner.generate(prompts, spec), engine, tools


def expected(tok, emitted, observations, end, budget, turn_tokens):
    """The episode as the concatenation of model, template and tool tokens, with its mask."""
    ids, mask = [], []
    for t, em in enumerate(emitted):
        em = em[:min(turn_tokens, budget - len(ids))]
        ids, mask = ids + em, mask + [1] * len(em)
        more = t + 1 < len(emitted) or (end == "length" and t < len(observations) and len(ids) < budget)
        if more and t < len(observations):
            tail = template_ids(tok, observations[t])[:budget - len(ids)]
            ids, mask = ids + tail, mask + [0] * len(tail)
    return ids, mask


@pytest.mark.heavy
def test_thousand_stub_episodes_are_token_exact(tok):
    budget, turn_tokens, max_turns = 250, 100, 3
    result, engine, tools = run(tok, 125, 8, max_turns=max_turns, budget=budget, turn_tokens=turn_tokens)
    assert len(result) == 1000 and result.response_mask is not None
    ends = {}
    for row in range(len(result)):
        i, j = result.prompt_index[row], result.sample_index[row]
        stats = result.episodes[row]
        want_ids, want_mask = expected(tok, engine.emitted[(i, j)], tools.seen.get(row, []), stats.end,
                                       budget, turn_tokens)
        assert result.response_ids[row] == want_ids, (i, j, stats)
        assert result.response_mask[row] == want_mask, (i, j)
        # log-probs: the model's on its tokens, 0 elsewhere
        assert all((lp == -0.5) == bool(m) for lp, m in zip(result.logprobs[row], want_mask))
        # limits as configured
        assert len(want_ids) <= budget and stats.turns <= max_turns
        assert stats.turns == len(engine.emitted[(i, j)])
        ends[stats.end] = ends.get(stats.end, 0) + 1
        if stats.end == "max_turns":
            assert stats.turns == max_turns
        if stats.end == "answered":  # its last turn called no tool (an answer, or a turn cut at the cap)
            assert "<tool_call>" not in stats.answer
    # every way to end occurred (the plans are random; 1,000 of them cover all)
    assert set(ends) == {"answered", "max_turns", "length"}, ends
    # the tokens really are not BPE's: re-encoding a decoded turn gives other ids
    em = engine.emitted[(0, 0)][0]
    assert tok(tok.decode(em), add_special_tokens=False)["input_ids"] != em


def test_turn_limit_ends_episodes(tok):
    result, engine, _ = run(tok, 20, 4, max_turns=1, budget=400, turn_tokens=400)
    assert {s.turns for s in result.episodes} == {1}
    for row, s in enumerate(result.episodes):
        assert s.end in ("answered", "max_turns", "length")
        assert all(result.response_mask[row])  # one turn: nothing but the model's tokens


def test_time_limit_ends_episodes(tok):
    # the responder takes 0.3 s per round, the limit is 0.1 s: every episode still going after the
    # first round of tool calls ends there, whatever the machine's load
    result, engine, _ = run(tok, 20, 4, max_turns=6, budget=400, turn_tokens=400, delay_s=0.3, timeout_s=0.1)
    ends = {s.end for s in result.episodes}
    assert "timeout" in ends and ends <= {"answered", "timeout", "length"}
    assert max(s.turns for s in result.episodes) == 1


def test_answer_is_the_last_model_turn(tok):
    result, engine, _ = run(tok, 30, 4, max_turns=6, budget=400, turn_tokens=400)
    answered = [r for r, s in enumerate(result.episodes) if s.end == "answered"]
    assert answered
    for row in answered:
        i, j = result.prompt_index[row], result.sample_index[row]
        last = engine.emitted[(i, j)][-1]
        assert result.episodes[row].answer == tok.decode(last, skip_special_tokens=True)
