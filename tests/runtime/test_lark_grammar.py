"""Lark grammars as structured outputs (runtime/engine/lark_grammar.py): each construct of the common subset
converts to EBNF that the engine's compile path accepts and that accepts the same strings as the Lark grammar;
sampled outputs of the tiny llama obey a Lark grammar; constructs outside the subset are a ValueError naming the
rule and the construct; an EBNF grammar passes unchanged."""

import re

import pytest

from fxrewrite.runtime.engine.lark_grammar import COMMON, ebnf_grammar, is_lark, lark_to_ebnf
from fxrewrite.runtime.engine.sampling_params import SamplingParams
from fxrewrite.runtime.engine.structured_outputs import StructuredOutputsParams
from fxrewrite.runtime.llm import LLM

import xgrammar as xgr  # noqa: E402 - the serve extra (`make setup` installs it): missing is a setup fault
from xgrammar.testing import _is_grammar_accept_string  # noqa: E402


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), model_impl="native", kv_cache_memory_bytes=4 << 20, max_model_len=128,
               max_num_seqs=16)


def accepts(lark: str, text: str) -> bool:
    return _is_grammar_accept_string(xgr.Grammar.from_ebnf(lark_to_ebnf(lark)), text)


# (Lark grammar, strings it accepts, strings it refuses)
CONSTRUCTS = {
    "prefix_and_alternatives": ('?start: "yes" | "no"', ["yes", "no"], ["", "yesno", "maybe"]),
    "keep_prefix": ('!start: "a" b\nb: "b"', ["ab"], ["a"]),
    "continuation_lines": ('start: "a"\n     | "b"\n  | "c" // last\n', ["a", "b", "c"], ["ab"]),
    "single_quotes": ("start: 'it' \"'s\" '\"'", ["it's\""], ["its"]),
    "escapes": (r'start: "\n\t\\\"\x41\u00e9\q"', ['\n\t\\"Aé\\q'], ["nt"]),
    "unicode": ('start: "😀é"', ["😀é"], ["é"]),
    "star_plus_optional": ('start: "a"* "b"+ "c"?', ["b", "aabbc", "bc"], ["a", "abcc"]),
    "optional_brackets": ('start: "x" ["y" "z"]', ["x", "xyz"], ["xy"]),
    "parentheses": ('start: ("a" | "b") ("c" "d")+', ["acd", "bcdcd"], ["ac", "abcd"]),
    "empty_alternative": ('start: "a" ( | "b")', ["a", "ab"], ["b"]),
    "repeat_tilde": ('start: "a" ~ 2 "b" ~ 1..3', ["aab", "aabbb"], ["ab", "aabbbb"]),
    "range_and_case": ('start: "a".."c" "ok"i', ["aOk", "cOK", "bok"], ["dok", "aoo"]),
    "alias_dropped": ('start: "a" b -> pair\n     | "c" -> single\nb: "b"', ["ab", "c"], ["a"]),
    "terminals": ('start: NAME "=" NUMBER\nNAME: /[a-z_]+/\nNUMBER: /[0-9]+/', ["ab_c=12"], ["Ab=1", "a="]),
    "comments_blank_lines": ('# hash\n\nstart: x  # trailing\n// slashes\nx: "x" // more', ["x"], ["y"]),
    "a_rule_named_root": ('start: root root\nroot: "r"', ["rr"], ["r"]),
    "regex_dot_and_escapes": (r'start: /./ /[\t\x41-\x43\-\]]+/', ["é\t", "xAC-]"], ["\n\t", "xD"]),
    "regex_negated_escaped": (r'start: "\"" /[^"\\\n]*/ "\""', ['"ab c"', '""'], ['"a"b"', '"a\\"']),
    "regex_count": ('start: /[0-9]{2,3}/', ["12", "123"], ["1", "1234"]),
    "imports": ("start: CNAME WS_INLINE SIGNED_NUMBER\n%import common.CNAME\n%import common (WS_INLINE, SIGNED_NUMBER)",
                ["_x1 -1.5e3", "a  7"], ["1x 1", "a 1e"]),
    "import_alias": ("start: D D\n%import common.DIGIT -> D", ["42"], ["4"]),
}


@pytest.mark.parametrize("name", CONSTRUCTS)
def test_each_construct_converts_and_means_the_same(llm, name):
    lark, good, bad = CONSTRUCTS[name]
    assert is_lark(lark)
    params = SamplingParams(structured_outputs=StructuredOutputsParams(grammar=lark))
    assert llm.llm_engine.compile_structured_outputs(params) is not None  # the engine's compile path
    for text in good:
        assert accepts(lark, text), (name, text, lark_to_ebnf(lark))
    for text in bad:
        assert not accepts(lark, text), (name, text, lark_to_ebnf(lark))


def test_the_conversion_reads_as_ebnf():
    assert lark_to_ebnf('?start: "yes" | "no"') == 'root ::= "yes" | "no"\n'
    assert lark_to_ebnf("start: [a] b*\na: 'x'\nb: /[a-z]/") == 'root ::= (a)? b*\na ::= "x"\nb ::= [a-z]\n'


# Lark's common.lark definitions, as Python regexes (Lark matches terminals with `re`)
COMMON_REGEXES = {
    "DIGIT": r"[0-9]", "HEXDIGIT": r"[0-9a-fA-F]", "INT": r"[0-9]+", "SIGNED_INT": r"[+-]?[0-9]+",
    "DECIMAL": r"[0-9]+\.[0-9]*|\.[0-9]+", "FLOAT": r"[0-9]+[eE][+-]?[0-9]+|([0-9]+\.[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?",
    "SIGNED_FLOAT": r"[+-]?([0-9]+[eE][+-]?[0-9]+|([0-9]+\.[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?)",
    "NUMBER": r"[0-9]+([eE][+-]?[0-9]+)?|([0-9]+\.[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?",
    "SIGNED_NUMBER": r"[+-]?([0-9]+([eE][+-]?[0-9]+)?|([0-9]+\.[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?)",
    "LCASE_LETTER": "[a-z]", "UCASE_LETTER": "[A-Z]", "LETTER": "[a-zA-Z]", "WORD": "[a-zA-Z]+",
    "CNAME": "[a-zA-Z_][a-zA-Z0-9_]*", "ESCAPED_STRING": r'"(?:[^"\\\n]|\\[^\n])*"', "WS_INLINE": "[ \t]+",
    "WS": "[ \t\f\r\n]+", "CR": "\r", "LF": "\n", "NEWLINE": "(\r?\n)+",
}
SAMPLES = ["0", "7", "42", "-3", "+1.5", "1.", ".5", "1e5", "1.5E-3", "e5", "1e", "..", "a", "Z", "ab", "a_1", "_",
           "1a", '"x"', '"a\\"b"', '"a"b"', '""', '"\n"', " ", " \t", "\n", "\r\n", "\n\n", "\r", "f", "FF", ""]


@pytest.mark.parametrize("name", COMMON)
def test_common_imports_match_lark(name):
    grammar = xgr.Grammar.from_ebnf(lark_to_ebnf(f"start: {name}\n%import common.{name}"))
    for text in SAMPLES:
        expected = re.fullmatch(COMMON_REGEXES[name], text, re.S) is not None
        assert _is_grammar_accept_string(grammar, text) == expected, (name, text)


def test_sampled_outputs_obey_a_lark_grammar(llm):
    grammars = [
        ('?start: "yes" | "no"', r"yes|no"),
        ('start: "(" ITEM ("," ITEM)* ")"\nITEM: /[a-c]/ | DIGIT\n%import common.DIGIT', r"\([a-c0-9](,[a-c0-9])*\)"),
        ("start: pair\n!pair: 'k' \"=\" [SIGNED_INT]\n%import common.SIGNED_INT", r"k=([+-]?[0-9]+)?"),
    ]
    params = [SamplingParams(n=6, temperature=1.0, seed=i, max_tokens=24,
                             structured_outputs=StructuredOutputsParams(grammar=g)) for i, (g, _) in enumerate(grammars)]
    outs = llm.generate(["Answer:"] * len(grammars), params, use_tqdm=False)
    for (grammar, pattern), out in zip(grammars, outs, strict=True):
        for c in out.outputs:  # an unbounded grammar may run to max_tokens: then a prefix of a valid output
            if c.finish_reason == "stop":
                assert re.fullmatch(pattern, c.text), (grammar, c.text)
            else:
                assert accepts_prefix(grammar, c.text), (grammar, c.text)
    assert all(c.finish_reason == "stop" for c in outs[0].outputs)


def accepts_prefix(lark: str, text: str) -> bool:
    return _is_grammar_accept_string(xgr.Grammar.from_ebnf(lark_to_ebnf(lark)), text, require_termination=False)


@pytest.mark.parametrize("grammar, message", [
    ('start: A\nA: "a"\n%ignore " "', r"line 3: %ignore .*xgrammar has no ignored tokens"),
    ("start: x\nx: /a+b/", r"rule 'x': the regex /a\+b/ \(only a character class"),
    ("start: x\nx: /[a-z]+/i", r"rule 'x': the regex flags 'i' of /\[a-z\]\+/i"),
    ("start: x\nx: /(?=a)[a]/", r"rule 'x': the regex"),
    ("start: x\nx: /\\d+/", r"rule 'x': the regex /\\d\+/ \(\\d, \\w and \\s match Unicode in Lark"),
    ("start: X\nX.2: \"a\"", r"rule 'X': a priority"),
    ("start: x{a}\nx{a}: a", r"rule 'start': '\{' here"),
    ("start: \"a\" & \"b\"", r"line 1: the character '&'"),
    ("start: x\n%import python.NAME", r"line 2: '%import python.NAME' \(only %import common.X"),
    ("start: X\n%import common.FOO", r"line 2: %import common.FOO"),
    ('start: "a\\x4"', r"rule 'start': the string .* \(an invalid escape\)"),
    ('start: "ab".."z"', r"rule 'start': the range"),
    ("start: a\n", r"rule 'start': 'a' is used but not defined"),
    ('begin: "a"', r"no 'start' rule"),
    ('start: "a"\nstart: "b"', r"rule 'start': defined twice"),
    ('start: ("a"', r"rule 'start': a definition that ends early"),
])
def test_outside_the_subset_is_a_clear_error(llm, grammar, message):
    with pytest.raises(ValueError, match=message) as info:
        lark_to_ebnf(grammar)
    assert "Lark grammar" in str(info.value)
    with pytest.raises(ValueError, match="invalid grammar for structured outputs: Lark grammar"):
        llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputsParams(grammar=grammar)),
                     use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_the_refusals_say_what_is_converted():
    with pytest.raises(ValueError, match="the common Lark subset is converted to EBNF"):
        lark_to_ebnf("start: x\nx: /a|b/")


@pytest.mark.parametrize("grammar", ['root ::= "a" | "b"', 'root ::= x\nx ::= "a:b"', 'root ::= "start: x"',
                                     "not a grammar at all"])
def test_ebnf_and_other_text_pass_unchanged(grammar):
    assert not is_lark(grammar) and ebnf_grammar(grammar) == grammar



@pytest.mark.parametrize("grammar", ['start: x\nx: x "a"', 'root ::= x\nx ::= x "a"'])
def test_a_grammar_that_accepts_no_string_is_refused_before_it_runs(grammar, llm):
    """A rule defined only through itself: no token can start the output. It was a RuntimeError "(a sampler bug)" at
    the first step (a 500 on the server, a final fresh user's find); now a ValueError before the request is queued."""
    with pytest.raises(ValueError, match="invalid grammar for structured outputs: it accepts no string"):
        llm.generate(["x"], SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(grammar=grammar)),
                     use_tqdm=False)
