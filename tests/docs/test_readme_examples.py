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


def test_every_results_file_the_docs_name_exists():
    """Figures in README.md and BENCHMARKS.md point at their JSON/log (issue 15 item 17): each named file
    must be in benchmarks/results/ (a `-latency.json` shorthand after a full name shares its prefix)."""
    root = README.parent
    results = {p.name for p in (root / "benchmarks" / "results").iterdir()}
    named = set()
    for doc in (README, root / "BENCHMARKS.md"):
        named |= set(re.findall(r"\b(20\d\d-\d\d-\d\d-[\w.-]+?\.(?:jsonl|json|log|png))\b", doc.read_text()))
    assert named, "no results file named in the docs"
    missing = sorted(n for n in named if n not in results)
    assert not missing, f"named in the docs but not in benchmarks/results/: {missing}"
