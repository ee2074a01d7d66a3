"""Prompts to text and token ids through the tokenizer's chat template.

Choice for plain-text prompts: they are wrapped as a single user message and rendered through the
chat template, like chat prompts, whenever the tokenizer has one. An instruct model then sees the
format it was tuned on whichever way a dataset stores its prompts, and the SFT warm start and the
RL run (which both call `render_prompt`) see byte-identical prompts. With `wrap_plain_text=False`,
or a tokenizer without a `chat_template`, the text is used raw and the tokenizer adds its own
special tokens (BOS) as it would for any text. Chat prompts without a template are an error.

A rendered template already holds the special tokens the model expects, so it is tokenised with
`add_special_tokens=False`: letting the tokenizer add a BOS again would give two.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

from verl_hpc.data.errors import DataError

Prompt = Union[str, List[dict]]


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def render_prompt(tokenizer, prompt: Prompt, wrap_plain_text: bool = True,
                  tools: Optional[List[dict]] = None) -> Tuple[str, bool]:
    """(text, templated): the prompt as the model will see it, ending where the response starts.
    tools: function schemas the template lists for the model (multi_turn; a template that does not
    use its `tools` variable ignores them)."""
    if isinstance(prompt, str) and not (wrap_plain_text and has_chat_template(tokenizer)):
        return prompt, False
    if not has_chat_template(tokenizer):
        raise DataError("a prompt is a list of chat messages but the tokenizer has no chat_template; "
                        "use a tokenizer with one, or plain-text prompts")
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    extra = {"tools": tools} if tools else {}
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)
    return text, True


def encode_prompts(tokenizer, prompts: Sequence[Prompt], wrap_plain_text: bool = True,
                   sample_ids: Optional[Sequence[str]] = None,
                   tools: Optional[Sequence[Optional[List[dict]]]] = None) -> Tuple[List[str], List[List[int]]]:
    """Rendered texts and their token ids, in one batched tokenizer call per kind. `sample_ids`
    only serve the error message when a template cannot render a prompt; tools[i]: prompt i's
    tool schemas (render_prompt)."""
    rendered = []
    for i, p in enumerate(prompts):
        try:
            rendered.append(render_prompt(tokenizer, p, wrap_plain_text, tools[i] if tools else None))
        except DataError as e:
            raise DataError(f"sample {sample_ids[i] if sample_ids else i}: {e}") from e
        except Exception as e:  # noqa: BLE001 - a Jinja template's own checks (roles must alternate, ...)
            raise DataError(f"sample {sample_ids[i] if sample_ids else i}: the tokenizer's chat_template cannot "
                            f"render this prompt ({type(e).__name__}: {e})") from e
    texts = [t for t, _ in rendered]
    token_ids: List[List[int]] = [[] for _ in prompts]
    for templated in (True, False):  # templated texts carry their own special tokens
        idx = [i for i, (_, tpl) in enumerate(rendered) if tpl == templated]
        if idx:
            enc = tokenizer([texts[i] for i in idx], add_special_tokens=not templated)["input_ids"]
            for i, row in zip(idx, enc):
                token_ids[i] = list(row)
    return texts, token_ids
