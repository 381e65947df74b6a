"""The README's token-id example means what it says for the default model (SmolLM2's tokenizer, which
the tiny Llama folder carries): issue 15 item 9."""

import ast
import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def test_dict_prompt_ids_are_the_default_models_tokens(tiny_llama_dir):
    from transformers import AutoTokenizer

    text = README.read_text()
    match = re.search(r'these ids are "([^"]+)" in the default model\'s tokenizer\n.*"prompt_token_ids": (\[[^\]]*\])',
                      text)
    assert match, "README's dict-prompt example not found"
    said, ids = match.group(1), ast.literal_eval(match.group(2))
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    assert len(tokenizer) == 49152  # SmolLM2's vocabulary, the default model's
    assert tokenizer.encode(said) == ids
