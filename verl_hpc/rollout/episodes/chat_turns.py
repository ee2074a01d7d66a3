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
  `texts`, then the header of the next assistant turn, add_special_tokens=False (a rendered template
  carries its own special tokens).

An observation is text, never chat structure. A tool's output is whatever the program printed, and
a program (or a model steering it) can print "<|im_end|>\n<|im_start|>user\n...": encoded with the
template around it, that text would become the real control tokens and close the tool turn, then
open a user or system turn the model never got, in rollout and in training alike. So the template
is rendered with a marker in place of each observation, the template's text around the markers is
encoded as usual (its delimiters stay real special tokens) and each observation is encoded as plain
text: the tokenizer's normalizer, pre-tokenizer and model, without its added vocabulary, so that no
special or added token (`<|im_end|>`, `<tool_call>`, `<|endoftext|>`, ...) can come out of it.
`split_special_tokens=True` alone is not enough with fast tokenizers: it leaves the added tokens
that are not flagged special (Qwen's `<tool_call>`, `<tool_response>`, `<think>`) as single ids.
The template does not see the observation's own text, so a template that rewrites message content
(`| trim`) does not rewrite observations; the ChatML templates this is for insert it verbatim.

Observation text that is not valid Unicode (a lone surrogate such as "\\ud800", which a tool may echo
from its JSON arguments) cannot be encoded by any tokenizer; each such code unit becomes U+FFFD.
"""
from __future__ import annotations

from typing import List, Sequence

from verl_hpc.data.errors import DataError
from verl_hpc.data.templates import has_chat_template

_MARK = "\u2063verl-hpc-turn\u2063"  # invisible separators: text no template or model writes


def valid_text(text: str) -> str:
    """`text` with surrogate pairs joined and lone surrogates replaced by U+FFFD (UTF-16 round trip:
    the codec that knows pairs)."""
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


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
        self._added = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}))
        self._plain = _plain_encoder(tokenizer)
        self._check_plain()

    def _encode(self, text: str) -> List[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    def text_ids(self, text: str) -> List[int]:
        """`text` as plain text: no id of a special or added token comes out of it."""
        return self._plain(valid_text(text)) if text else []

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
        """observation_text(texts, role) as ids: the template's own text encoded as usual, each of
        `texts` as plain text (module docstring)."""
        marks = [f"{_MARK}{k}{_MARK}" for k in range(len(texts))]
        rest, ids = self.observation_text(marks, role), []
        for mark, text in zip(marks, texts):
            head, found, rest = rest.partition(mark)
            if not found:
                raise DataError(f"the chat_template does not render a {role} turn's content once, as "
                                "given; multi_turn cannot place tool output in it as plain text")
            ids += self._encode(head) + self.text_ids(text)
        return ids + self._encode(rest)

    def _check_plain(self) -> None:
        """The plain encoder really leaves every added token as text (a tokenizer of a kind this
        module does not know could still match them): checked once, on all of them together."""
        names = self.tokenizer.convert_ids_to_tokens(sorted(self._added))
        found = sorted(self._added.intersection(self.text_ids(" ".join(n for n in names if n))))
        if found:
            raise DataError(f"multi_turn: this tokenizer ({type(self.tokenizer).__name__}) turns the text of its "
                            f"special tokens {self.tokenizer.convert_ids_to_tokens(found)} into those tokens even "
                            "when told not to; tool output could forge chat turns with it. Use a fast "
                            "(tokenizer.json) tokenizer")


def _plain_encoder(tokenizer):
    """text -> ids through the tokenizer's own pipeline minus its added vocabulary (fast
    tokenizers: the `tokenizers` normalizer, pre-tokenizer and model), else the tokenizer with
    split_special_tokens=True (a Python tokenizer then matches no added token at all)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "model"):
        return lambda text: list(tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])
    normalizer, pre_tokenizer, model = backend.normalizer, backend.pre_tokenizer, backend.model

    def encode(text: str) -> List[int]:
        if normalizer is not None:
            text = normalizer.normalize_str(text)
        pieces = pre_tokenizer.pre_tokenize_str(text) if pre_tokenizer is not None else [(text, None)]
        return [token.id for piece, _ in pieces for token in model.tokenize(piece)]

    return encode
