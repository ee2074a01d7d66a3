"""The two chat tokenizers of the multi-turn tests: the tiny model's (verl_hpc/models/tiny.py: a BPE
with <|im_start|>/<|im_end|> and a plain ChatML template) and a Qwen-style one: the same trained
BPE with the added vocabulary of a Qwen3 instruct tokenizer (its special flags as there: the
vision and ChatML tokens special, the tool, FIM and think tags added but not special) and a chat
template written here in the shape of Qwen's (tools listed in a system turn, consecutive tool
outputs grouped in one user turn as <tool_response> blocks)."""
from tokenizers import AddedToken, Tokenizer

# (content, special) in Qwen3's order
QWEN_ADDED = [(t, True) for t in (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")] + [(t, False) for t in (
        "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
        "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>")]

QWEN_STYLE_TEMPLATE = r"""
{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
{{- '# Tools\n\nYou may call functions. Their signatures:\n<tools>' }}
{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
{{- '\n</tools>\n\nWrite each call as <tool_call>{"name": ..., "arguments": {...}}</tool_call>.<|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
{%- elif not (message.role == 'system' and loop.first) %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
""".strip()


def tiny_tokenizer():
    from verl_hpc.models.tiny import train_tokenizer

    return train_tokenizer()


def qwen_style_tokenizer():
    from transformers import PreTrainedTokenizerFast

    from verl_hpc.models.tiny import _trained_bpe

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(_trained_bpe(480, 0)),
                                  chat_template=QWEN_STYLE_TEMPLATE, model_max_length=256)
    tok.add_tokens([AddedToken(t, special=s, normalized=False) for t, s in QWEN_ADDED if s], special_tokens=True)
    tok.add_tokens([AddedToken(t, special=s, normalized=False) for t, s in QWEN_ADDED if not s])
    tok.eos_token, tok.pad_token = "<|im_end|>", "<|endoftext|>"
    return tok


def added_tokens(tok) -> dict:
    """{content: id} of every special and added token of `tok`."""
    ids = set(tok.all_special_ids) | set(tok.added_tokens_decoder)
    return {tok.convert_ids_to_tokens(i): i for i in sorted(ids)}
