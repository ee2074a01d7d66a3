"""The chat template's turn delimiters as token ids, for appending turns to an episode.

An episode is extended by token ids, never by re-rendering and re-encoding the conversation: the
model's tokens stay exactly as sampled (re-tokenizing decoded text can split them differently, which
trains the policy on tokens it never produced). What an episode appends after a model turn is
derived from the template once per tokenizer, by rendering a fixed conversation with a marker and
taking the text around it:

- `close_ids(last)`: what closes an assistant turn in the template (ChatML: "<|im_end|>\n"). A turn
  that a stop string ended (`</tool_call>`) has not written it; a turn whose last sampled token is
  the start of it (a model whose EOS is "<|im_end|>") gets only the rest.
- `observation_ids(texts, role)`: the turns of `role` ("tool", or "user" for an environment) holding
  `texts`, then the header of the next assistant turn, tokenized together, once, with
  add_special_tokens=False (a rendered template carries its own special tokens).
"""
from __future__ import annotations

from typing import List, Sequence

from verl_hpc.data.errors import DataError
from verl_hpc.data.templates import has_chat_template

_MARK = "\u2063verl-hpc-turn\u2063"  # invisible separators: text no template or model writes


class TurnCodec:
    def __init__(self, tokenizer):
        if not has_chat_template(tokenizer):
            raise DataError("multi_turn.enable needs a tokenizer with a chat_template: the turns of an "
                            "episode are delimited by it")
        self.tokenizer = tokenizer
        self._history = [{"role": "user", "content": "q"}, {"role": "assistant", "content": _MARK}]
        self._base = tokenizer.apply_chat_template(self._history, tokenize=False)
        self._closer = self._base[self._base.rindex(_MARK) + len(_MARK):]
        self._close_cache: dict = {}

    def _encode(self, text: str) -> List[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    def close_ids(self, last_token: int) -> List[int]:
        """Tokens that close a model turn whose last sampled token is `last_token`."""
        if last_token not in self._close_cache:
            last = self.tokenizer.decode([last_token], skip_special_tokens=False)
            rest = self._closer[len(last):] if last and self._closer.startswith(last) else self._closer
            self._close_cache[last_token] = self._encode(rest)
        return list(self._close_cache[last_token])

    def observation_text(self, texts: Sequence[str], role: str = "tool") -> str:
        """The template's text for `texts` as `role` turns plus the next assistant header."""
        turns = [{"role": role, "content": t} for t in texts]
        full = self.tokenizer.apply_chat_template(self._history + turns, tokenize=False,
                                                  add_generation_prompt=True)
        if not full.startswith(self._base):
            raise DataError("the chat_template renders earlier turns differently once a "
                            f"{role} turn follows; multi_turn cannot extend episodes by tokens with it")
        return full[len(self._base):]

    def observation_ids(self, texts: Sequence[str], role: str = "tool") -> List[int]:
        return self._encode(self.observation_text(texts, role))
