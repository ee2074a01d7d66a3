"""Fixtures for the data tests: a tiny locally trained BPE tokenizer with a chat template, and
helpers that write prompt files (the tests never read data they did not write)."""
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CORPUS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    "How many clips did Natalia sell altogether in April and May?",
    "3+4=7 5+5=10 9+8=17 2+2=4 1+0=1 6+3=9",
    "What is the value of x if 2x + 3 = 11? The answer is 4.",
    "You are a helpful assistant. Please answer the question.",
] * 20


def _build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    # raw text gets a BOS from the tokenizer, as Llama-style tokenizers do
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


@pytest.fixture(scope="session")
def tokenizer():
    return _build_tokenizer()


@pytest.fixture(scope="session")
def make_tokenizer():
    """A builder, for tests that change a tokenizer (the session one is shared)."""
    return _build_tokenizer


@pytest.fixture(scope="session")
def plain_tokenizer():
    """The same tokenizer without a chat template."""
    tok = _build_tokenizer()
    tok.chat_template = None
    return tok


class Files:
    """Writes prompt files into a test's tmp_path: files.jsonl("a.jsonl", rows), files.parquet(...)."""

    def __init__(self, root):
        self.root = root

    def jsonl(self, name, rows, blank_after=()):
        """One JSON object per line (a str row is written as it is); a blank line after each index in blank_after."""
        path = self.root / name
        with open(path, "w") as f:
            for i, r in enumerate(rows):
                f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
                if i in blank_after:
                    f.write("\n")
        return str(path)

    def parquet(self, name, rows):
        path = self.root / name
        pq.write_table(pa.Table.from_pylist(rows), str(path))
        return str(path)

    @staticmethod
    def row(i, source="gsm8k", truth=None, **kw):
        out = {"prompt": f"What is {i} plus {i}?", "data_source": source, "ground_truth": truth or str(2 * i)}
        out.update(kw)
        return out


@pytest.fixture
def files(tmp_path):
    return Files(tmp_path)
