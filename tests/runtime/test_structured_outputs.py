"""Structured outputs in the offline API (xgrammar): sampled outputs at temperature 1.0 on a tiny random
llama all parse and validate; regex, choice and grammar constraints hold; bad constraints are a
ValueError naming the problem before anything is queued."""

import json
import re
from types import SimpleNamespace

import pytest

from fxrewrite.runtime.engine.sampling_params import SamplingParams
from fxrewrite.runtime.engine.structured_outputs import StructuredOutputsParams
from fxrewrite.runtime.llm import LLM

import xgrammar  # noqa: E402,F401 - the serve extra (`make setup` installs it): missing is a setup fault
import jsonschema  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        # A pattern, not maxLength: xgrammar 0.2.9's bounded-length strings admit raw control characters.
        "name": {"type": "string", "pattern": "^[A-Za-z][a-z]{0,7}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}
NUM_SAMPLES = 48  # benchmarks/structured_outputs.py samples more (--num-samples)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), model_impl="native", kv_cache_memory_bytes=16 << 20, max_model_len=256,
               max_num_seqs=128)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_sampled_json_always_validates(tiny_llama_dir, llm, async_scheduling):
    if not async_scheduling:
        llm = LLM(str(tiny_llama_dir), model_impl="native", kv_cache_memory_bytes=4 << 20, max_model_len=256,
                  async_scheduling=False)
    n = NUM_SAMPLES if async_scheduling else 10
    params = SamplingParams(n=n, temperature=1.0, max_tokens=120, seed=0,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True))
    out = llm.generate(["Give me a person as JSON:"], params, use_tqdm=False)[0]
    assert len(out.outputs) == n
    for c in out.outputs:
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), SCHEMA)
    assert len({c.text for c in out.outputs}) > n // 2  # really sampled
    bm = llm.llm_engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not llm.llm_engine._structured.constrained


def test_regex_choice_and_grammar(llm):
    prompts = ["a", "b", "c"]
    params = [
        SamplingParams(n=5, temperature=1.0, max_tokens=30, structured_outputs=StructuredOutputsParams(
            regex=r"[0-9]{3}-[a-z]{2}")),
        SamplingParams(n=5, temperature=1.0, max_tokens=30, structured_outputs=StructuredOutputsParams(
            choice=["yes", "no", "maybe \"so\""])),
        SamplingParams(n=5, temperature=1.0, max_tokens=30, structured_outputs=StructuredOutputsParams(
            grammar='root ::= "(" [a-c]+ ")"')),
        SamplingParams(n=3, temperature=1.0, max_tokens=30),  # unconstrained neighbours
    ]
    outs = llm.generate(prompts + ["d"], params, use_tqdm=False)
    assert all(re.fullmatch(r"[0-9]{3}-[a-z]{2}", c.text) for c in outs[0].outputs)
    assert all(c.text in ("yes", "no", 'maybe "so"') for c in outs[1].outputs)
    for c in outs[2].outputs:  # [a-c]+ may outlast max_tokens at random: then a valid prefix
        assert re.fullmatch(r"\([a-c]+\)" if c.finish_reason == "stop" else r"\([a-c]*", c.text), c


def test_bans_give_way_to_the_grammar(llm):
    """min_tokens, allowed_token_ids and bad_words with a grammar (vLLM accepts them): a ban the grammar leaves room
    for holds (no "7" in four digits; only "yes" among the choices); a step where they forbid every token the grammar
    allows samples from the grammar alone (EOS before min_tokens once the choice is complete, a bad word that is the
    whole regex, allowed ids outside the grammar)."""
    tok = llm.get_tokenizer()
    yes = tok.encode("yes", add_special_tokens=False)
    cases = [
        (dict(bad_words=["7"]), dict(regex="[0-9]{4}"), lambda t: re.fullmatch("[0-689]{4}", t)),
        (dict(allowed_token_ids=yes + [tok.eos_token_id]), dict(choice=["yes", "no"]), lambda t: t == "yes"),
        (dict(min_tokens=20), dict(choice=["yes", "no"]), lambda t: t in ("yes", "no")),
        (dict(bad_words=["7"]), dict(regex="7"), lambda t: t == "7"),
        (dict(allowed_token_ids=[0, 1]), dict(choice=["yes", "no"]), lambda t: t in ("yes", "no")),
    ]
    params = [SamplingParams(n=6, temperature=1.0, seed=i, max_tokens=30,
                             structured_outputs=StructuredOutputsParams(**grammar), **extra)
              for i, (extra, grammar, _) in enumerate(cases)]
    outs = llm.generate(["a"] * len(cases), params, use_tqdm=False)
    for (extra, grammar, ok), out in zip(cases, outs, strict=True):
        for c in out.outputs:
            assert c.finish_reason == "stop" and ok(c.text), (extra, grammar, c.text)
    assert all(len(c.token_ids) < 20 for c in outs[2].outputs)
    bm = llm.llm_engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_grammar_row_replaces_a_row_the_bans_emptied():
    import torch

    from fxrewrite.runtime.engine.sampler import _mask_grammar_first

    logits = torch.randn(3, 64)
    bitmask = torch.zeros(3, 2, dtype=torch.int32)
    bitmask[:, 0] = 0b1100  # the grammar allows tokens 2 and 3
    edited = logits.clone()
    edited[0, 2:4] = float("-inf")  # row 0: the bans take both
    edited[1, 2] = float("-inf")  # row 1: one is left
    edited[2] += 1.0  # row 2: a penalty-like shift
    out = _mask_grammar_first(logits, edited, bitmask)
    assert torch.equal(out[0, 2:4], logits[0, 2:4]) and torch.isneginf(out[0, 4:]).all()
    assert torch.isneginf(out[1, 2]) and out[1, 3] == logits[1, 3] and torch.isneginf(out[1, 4:]).all()
    assert torch.equal(out[2, 2:4], logits[2, 2:4] + 1.0)
    plain = logits.clone()
    assert _mask_grammar_first(plain, plain, bitmask) is plain and torch.isneginf(plain[:, :2]).all()


@pytest.mark.parametrize("bad, message", [
    (StructuredOutputsParams(json={"type": "objec"}), "invalid json.*objec"),
    (StructuredOutputsParams(json="{not json"), "invalid json"),
    (StructuredOutputsParams(regex="(ab"), "invalid regex.*parenthesis"),
    (StructuredOutputsParams(grammar="root ::= foo"), "invalid grammar.*foo"),
    # keywords xgrammar would drop (a fresh user got "[0, 3, 0]" for uniqueItems, finished with "stop")
    (StructuredOutputsParams(json={"type": "array", "items": {"type": "integer"}, "uniqueItems": True}),
     "invalid json.*'uniqueItems' at / is not enforced by xgrammar"),
    (StructuredOutputsParams(json='{"type": "object", "properties": {"t": {"type": "array", "contains": {}}}}'),
     "'contains' at /properties/t is not enforced"),
    (StructuredOutputsParams(json={"type": "string", "pattern": "^[A-Z]+$", "maxLength": 5}),
     "'minLength' / 'maxLength' beside 'pattern' at / are not enforced"),
    (StructuredOutputsParams(json={"type": "number", "multipleOf": 0.5}), "'multipleOf' on a number"),
])
def test_bad_constraints_are_refused_before_queueing(llm, bad, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(["x"], SamplingParams(structured_outputs=bad), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_the_dropped_keywords_are_the_ones_xgrammar_drops():
    """Each keyword `json_schema_check` refuses is one xgrammar compiles away (it accepts a string the keyword
    forbids), and the neighbours it passes are enforced: when an xgrammar release starts enforcing one, this
    fails and the refusal can go."""
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    from fxrewrite.runtime.engine.json_schema_check import unenforced_keyword

    def accepts(schema, text):
        grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
        return _is_grammar_accept_string(grammar, json.dumps(json.loads(text)))

    ints = {"type": "integer"}
    dropped = [({"type": "array", "items": ints, "uniqueItems": True}, "[1, 1]"),
               ({"type": "array", "items": ints, "contains": {"const": 5}}, "[1]"),
               ({"not": ints}, "1"), ({"type": "integer", "if": {"minimum": 5}, "then": {"maximum": 3}}, "7"),
               ({"type": "object", "properties": {"a": ints}, "dependentRequired": {"a": ["b"]}}, '{"a": 1}'),
               ({"allOf": [ints, {"minimum": 5}]}, "1"), ({"type": "number", "multipleOf": 0.5}, "0.3"),
               ({"type": "string", "pattern": "^[A-Z]+$", "maxLength": 2}, '"ABCDE"'),
               ({"type": "string", "format": "date", "minLength": 20}, '"7788-10-17"'),
               ({"type": "integer", "multipleOf": 7, "maximum": 1000}, "725")]
    for schema, text in dropped:
        assert accepts(schema, text) and unenforced_keyword(schema), schema
    enforced = [({"type": "integer", "multipleOf": 3}, "4"), ({"type": "string", "maxLength": 2}, '"abc"'),
                ({"type": "integer", "multipleOf": 7, "minimum": 0, "maximum": 1000}, "725"),
                ({"type": "object", "maxProperties": 1}, '{"a": 1, "b": 2}'),
                ({"type": "object", "propertyNames": {"pattern": "^a"}}, '{"b": 1}'),
                ({"type": "string", "format": "date"}, '"x"')]
    for schema, text in enforced:
        assert not accepts(schema, text) and unenforced_keyword(schema) is None, schema


def test_params_need_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(json={}, regex="a")
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(TypeError, match="structured_outputs"):
        SamplingParams(structured_outputs={"json": {}})


def test_sampler_bitmask_equals_xgrammar_apply():
    import torch
    import xgrammar as xgr

    from fxrewrite.runtime.engine.sampler import apply_token_bitmask, apply_token_bitmask_reference

    vocab = 1000
    logits = torch.randn(8, vocab)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (8, (vocab + 31) // 32), dtype=torch.int32)
    bitmask[2] = -1  # an unconstrained row
    expected = logits.clone()
    xgr.apply_token_bitmask_inplace(expected, bitmask)
    ours, reference = logits.clone(), logits.clone()
    apply_token_bitmask(ours, bitmask)
    apply_token_bitmask_reference(reference, bitmask)
    assert torch.equal(ours, expected) and torch.equal(reference, expected)
    assert torch.equal(ours[2], logits[2])


@pytest.mark.parametrize("use_process", [True, False])
def test_manager_batches_accept_and_fill(llm, use_process):
    """accept_tokens' completed set is xgrammar's is_terminated; fill_bitmask gives all-ones rows to
    unconstrained sequences and the matcher's own mask to constrained ones, reusing its two slots; the
    same in the grammar process and in this one."""
    import torch
    import xgrammar as xgr

    from fxrewrite.runtime.engine.structured_outputs import StructuredOutputManager

    engine = llm.llm_engine
    manager = StructuredOutputManager(llm.get_tokenizer(), engine.model_config.vocab_size, engine.eos_token_ids,
                                      max_rows=8, use_process=use_process)
    assert (manager.process is not None) == use_process
    params = StructuredOutputsParams(choice=["yes", "no"])
    compiled = manager.compile(params)
    yes = llm.get_tokenizer().encode("yes", add_special_tokens=False)
    eos = min(engine.eos_token_ids)
    manager.add(-1, params, compiled)
    manager.add(-2, params)
    reference = xgr.GrammarMatcher(compiled)

    def step(seq_ids, tokens):
        return [(SimpleNamespace(seq_id=s, is_finished=False), SimpleNamespace(token_id=t))
                for s, t in zip(seq_ids, tokens)]

    try:
        assert manager.accept_tokens(step([-1, -3, -2], yes[:1] + [5] + yes[:1])) == set()
        assert reference.accept_token(yes[0])
        masks = [manager.fill_bitmask([-3, -1, -2], torch.device("cpu")).clone() for _ in range(3)]
        assert all(torch.equal(m, masks[0]) for m in masks)
        assert (masks[0][0] == -1).all()
        expected = xgr.allocate_token_bitmask(1, manager.vocab_size)
        reference.fill_next_token_bitmask(expected, 0)
        assert torch.equal(masks[0][1], expected[0]) and torch.equal(masks[0][2], expected[0])
        for token in yes[1:]:
            assert manager.accept_tokens(step([-1], [token])) == set()
        assert manager.accept_tokens(step([-1], [eos])) == {-1}
        bits = ((masks[0][2][:, None] >> torch.arange(32, dtype=torch.int32)) & 1).flatten()
        banned = int((bits[: manager.vocab_size] == 0).nonzero()[0])
        with pytest.raises(RuntimeError, match="violates its grammar"):
            manager.accept_tokens(step([-2], [banned]))
    finally:
        manager.remove(-1)
        manager.remove(-2)
        manager.close()
    assert not manager.constrained


def test_engines_of_one_tokenizer_share_the_grammar_compiler(tiny_llama_dir):
    """The vocabulary scan (xgrammar's TokenizerInfo, seconds for a large vocabulary) is done once per tokenizer
    folder per process; another vocab size (or folder, or stop set: the same key) gets its own compiler."""
    from transformers import AutoTokenizer

    from fxrewrite.runtime.engine.structured_outputs import StructuredOutputManager

    def manager(vocab_size):
        return StructuredOutputManager(AutoTokenizer.from_pretrained(tiny_llama_dir), vocab_size, {2}, use_process=False)

    first = manager(49152)
    assert manager(49152).compiler is first.compiler and manager(49152)._info is first._info
    assert manager(49152 + 64).compiler is not first.compiler


def test_a_deep_json_schema_reaches_the_grammar_process_as_text():
    import pickle

    schema = {"type": "integer"}
    for _ in range(900):
        schema = {"type": "array", "items": schema}
    spec = StructuredOutputsParams(json=schema).spec()
    assert spec[0] == "json" and json.loads(spec[1]) == schema
    pickle.dumps(spec)  # a nested dict this deep exceeds pickle's recursion limit


def test_concurrent_first_constrained_requests_share_one_manager(tiny_llama_dir, monkeypatch):
    """fresh-9 F1: the server compiles requests' grammars from several threads; the first ones each made a
    StructuredOutputManager, and requests added to a replaced one were sampled unconstrained."""
    import threading
    import time

    from fxrewrite.runtime.engine import llm_engine

    made = []

    class SlowManager(llm_engine.StructuredOutputManager):
        def __init__(self, *args, **kwargs):
            time.sleep(0.05)  # the vocabulary scan's time, so that unsynchronised first calls overlap
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(llm_engine, "StructuredOutputManager", SlowManager)
    llm = LLM(str(tiny_llama_dir), model_impl="native", kv_cache_memory_bytes=4 << 20, max_model_len=256)
    params = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    barrier = threading.Barrier(6)

    def first_call():
        barrier.wait()
        llm.llm_engine.compile_structured_outputs(params)

    threads = [threading.Thread(target=first_call) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(made) == 1 and llm.llm_engine._structured is made[0]
    assert llm.generate(["Answer:"], params, use_tqdm=False)[0].outputs[0].text in ("yes", "no")


def test_a_choice_past_the_basic_plane_can_be_generated():
    """A choice holding an emoji: its grammar accepts it (JSON's surrogate-pair escapes had made it unmatchable)."""
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    from fxrewrite.runtime.engine.grammar_worker import choice_grammar

    grammar = xgr.Grammar.from_ebnf(choice_grammar(["😀 yes", 'a "quoted"\\ne', "no"]))
    for text in ("😀 yes", 'a "quoted"\\ne', "no"):
        assert _is_grammar_accept_string(grammar, text), text
    assert not _is_grammar_accept_string(grammar, "yes")
