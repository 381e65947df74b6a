"""What the engine does for the optional parts of a request: logprob limits, allowed tokens, prompt logprobs.

Kept beside `llm_engine.py` so the engine's step loop stays readable.
"""

from __future__ import annotations

from pathlib import Path

from fxrewrite.errors import UserInputError
from fxrewrite.runtime.engine.outputs import Logprob
from fxrewrite.runtime.engine.prompt_logprobs import PromptLogprobsChunk
from fxrewrite.runtime.engine.sampling_params import SamplingParams
from fxrewrite.runtime.engine.sequence import Sequence
from fxrewrite.runtime.model_files.folders import read_json_object


def check_request_extras(params: SamplingParams, config, vocab_size: int) -> None:
    """ValueError for logprobs / prompt_logprobs above `config.max_logprobs` (vLLM's limit, default 20; -1: the
    vocabulary size), or a logit_bias, allowed_token_ids or stop_token_ids token outside the vocabulary."""
    max_logprobs = vocab_size if config.max_logprobs == -1 else config.max_logprobs
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        asked = vocab_size if value == -1 else value
        shown = f"{name}=-1 (the whole vocabulary, {vocab_size})" if value == -1 else f"{name}={value}"
        if asked is not None and asked > max_logprobs:
            if config.max_logprobs == -1:
                raise ValueError(f"{shown} is more than the vocabulary size ({vocab_size}; the engine's "
                                 "max_logprobs=-1 allows up to it)")
            raise ValueError(f"{shown} is more than max_logprobs={max_logprobs}; ask for at most "
                             f"{max_logprobs}, or start the engine with a larger max_logprobs (-1: no limit)")
    for name in ("logit_bias", "allowed_token_ids", "stop_token_ids"):
        bad = [t for t in (getattr(params, name) or ()) if t >= vocab_size]
        if bad:
            raise ValueError(f"{name} token id {bad[0]} is out of range [0, {vocab_size})")


def whole_vocabulary_logprobs(params: SamplingParams, vocab_size: int) -> SamplingParams:
    """`params`, or a clone with logprobs / prompt_logprobs -1 (vLLM's "the whole vocabulary") set to `vocab_size`,
    what the sampler and the outputs count (the caller's object is left as it was)."""
    if params.logprobs != -1 and params.prompt_logprobs != -1:
        return params
    params = params.clone()
    params.logprobs = vocab_size if params.logprobs == -1 else params.logprobs
    params.prompt_logprobs = vocab_size if params.prompt_logprobs == -1 else params.prompt_logprobs
    return params


def check_allowed_tokens(params: SamplingParams, bad_words: list[list[int]], eos_ids: set[int]) -> None:
    """UserInputError when allowed_token_ids leave no token the sampler may pick: every one a one-token bad word,
    or (while min_tokens holds) a stop token. The sampler would otherwise sample from a row of -inf (token 0)."""
    if params.allowed_token_ids is None:
        return
    banned = {ids[0] for ids in bad_words if len(ids) == 1}
    if params.min_tokens > 0:
        banned |= set(params.stop_token_ids or ()) | (set() if params.ignore_eos else eos_ids)
    if set(params.allowed_token_ids) <= banned:
        why = f"a one-token bad word{f' or, with min_tokens={params.min_tokens}, a stop token' if params.min_tokens else ''}"
        raise UserInputError(f"allowed_token_ids={params.allowed_token_ids} leave no token to sample: "
                             f"each is {why}; expected at least one other")


def store_prompt_logprobs(seqs: dict[int, Sequence], chunks: list[PromptLogprobsChunk], decode) -> None:
    """Write each chunk's {token_id: Logprob} dicts into its sequence's `prompt_logprobs` (position by
    position, so a recomputed chunk after preemption just writes the same values again)."""
    for chunk in chunks:
        seq = seqs.get(chunk.seq_id)
        if seq is None or seq.prompt_logprobs is None:
            continue
        for j, token_id in enumerate(chunk.token_ids):
            entry = {token_id: Logprob(chunk.logprobs[j], chunk.ranks[j], decode(token_id))}
            for r, (t, lp) in enumerate(zip(chunk.top_ids[j], chunk.top_logprobs[j]), start=1):
                if t not in entry:
                    entry[t] = Logprob(lp, r, decode(t))
            seq.prompt_logprobs[chunk.first_pos + j] = entry


def eos_token_ids(tokenizer, model_config) -> set[int]:
    """EOS ids: the tokenizer's plus generation_config.json's (which may list several)."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    gen_eos = getattr(model_config, "generation_eos_token_ids", None)
    if gen_eos is None:
        gen_eos = _read_generation_eos(model_config)
    ids.update(gen_eos)
    return ids


def _read_generation_eos(model_config) -> list[int]:
    """generation_config.json's eos_token_id (an int or a list of ints), else the config's. UserInputError naming the
    file when it is not a JSON object or its eos_token_id is something else."""
    path = Path(model_config.model_path) / "generation_config.json"
    if not path.exists():
        eos = getattr(model_config.hf_text_config, "eos_token_id", None)
    else:
        eos = read_json_object(path).get("eos_token_id")
    if eos is None:
        return []
    ids = [eos] if not isinstance(eos, list) else eos
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise UserInputError(f"{path}: eos_token_id={eos!r}; expected a token id or a list of token ids")
    return ids
