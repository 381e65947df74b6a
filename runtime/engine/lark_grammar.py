"""Lark grammar -> xgrammar EBNF (GBNF): the common Lark subset vLLM's users send as `guided_grammar`.

`ebnf_grammar(text)` returns an EBNF grammar (one with a `name ::=` rule line) unchanged and converts one
that looks like Lark (`name:` rule lines, `%import`): rules and terminals alike become `name ::= ...`
(`?name` / `!name` lose their prefix, `start` becomes `root`), `|` alternatives (also on continuation
lines), "strings" and 'strings' (Python escapes, as Lark reads them; `"abc"i` case-insensitive),
`"a".."z"` ranges, regex literals that are one character class (`/[0-9]+/`, `/[^"\\\\]/`, `/./`) with an
optional quantifier, `*` `+` `?`, `[x]` (= `x?`), `( )`, `x ~ n` / `x ~ n..m`, `-> alias` (dropped: it
shapes Lark's tree, not the language), `//` and `#` comments, and `%import common.X` for Lark's common
terminals (written out below). Anything else (`%ignore`: xgrammar has no ignored tokens; other regexes;
regex flags; priorities; templates) is a UserInputError (a ValueError, so the server answers 400) naming
the rule and the construct.
"""

from __future__ import annotations

import ast
import functools
import json
import re
import warnings

from fxrewrite.errors import UserInputError

__all__ = ["ebnf_grammar", "is_lark", "lark_to_ebnf"]

SUBSET = ("the common Lark subset is converted to EBNF: rules, terminals, | alternatives, strings, "
          "character-class regexes such as /[0-9]+/, ( ) [ ] * + ? ~, -> aliases, %import common.X")

_EBNF_RULE = re.compile(r"^\s*[A-Za-z_][\w.-]*\s*::=", re.M)
_LARK_LINE = re.compile(r"^\s*(?:[?!]?[A-Za-z_]\w*\s*(?:\.\s*-?\d+\s*)?:(?!:)|%(?:import|ignore)\b)", re.M)
_TOKEN = re.compile(r"""
    (?P<ws>[ \t\f\r]+)
  | (?P<comment>//.*|\#.*)
  | (?P<string>"(?:[^"\\\n]|\\.)*"i?|'(?:[^'\\\n]|\\.)*'i?)
  | (?P<regex>/(?:[^/\\\n]|\\.)+/[a-zA-Z]*)
  | (?P<name>[A-Za-z_]\w*)
  | (?P<number>\d+)
  | (?P<op>->|\.\.|[:|()\[\]*+?!~{},.%])
""", re.X)
_DIGITS, _LETTERS = "[0-9]", "[a-zA-Z]"
_EXP = '([eE] [+\\-]? [0-9]+)'
_DEC = '([0-9]+ "." [0-9]* | "." [0-9]+)'
_NUMBER = f'[0-9]+ {_EXP}? | {_DEC} {_EXP}?'
COMMON = {
    "DIGIT": _DIGITS, "HEXDIGIT": "[0-9a-fA-F]", "INT": "[0-9]+", "SIGNED_INT": "[+\\-]? [0-9]+",
    "DECIMAL": _DEC, "FLOAT": f"[0-9]+ {_EXP} | {_DEC} {_EXP}?", "SIGNED_FLOAT": f"[+\\-]? ([0-9]+ {_EXP} | {_DEC} {_EXP}?)",
    "NUMBER": _NUMBER, "SIGNED_NUMBER": f"[+\\-]? ({_NUMBER})",
    "LCASE_LETTER": "[a-z]", "UCASE_LETTER": "[A-Z]", "LETTER": _LETTERS, "WORD": "[a-zA-Z]+",
    "CNAME": "[a-zA-Z_] [a-zA-Z0-9_]*",
    "ESCAPED_STRING": '"\\"" ([^"\\\\\\n] | "\\\\" [^\\n])* "\\""',
    "WS_INLINE": "[ \\t]+", "WS": "[ \\t\\f\\r\\n]+", "CR": '"\\r"', "LF": '"\\n"', "NEWLINE": '("\\r"? "\\n")+',
}
"""Lark's common.lark terminals, each written out in EBNF (the same language, no helper rules)."""


def is_lark(text: str) -> bool:
    """Whether `text` is a Lark grammar: no EBNF rule line (`name ::=`) and a Lark rule line or directive."""
    return not _EBNF_RULE.search(text) and bool(_LARK_LINE.search(text))


def ebnf_grammar(text: str) -> str:
    """`text` as xgrammar's EBNF: converted when it is Lark (`is_lark`), else unchanged."""
    return lark_to_ebnf(text) if is_lark(text) else text


def _refuse(where: str, what: str) -> UserInputError:
    return UserInputError(f"Lark grammar, {where}: {what} is not supported ({SUBSET})")


def _tokens(line: str, number: int) -> list[tuple[str, str]]:
    """(kind, text) of one line, without blanks and comments."""
    out, pos = [], 0
    while pos < len(line):
        m = _TOKEN.match(line, pos)
        if m is None:
            raise _refuse(f"line {number}", f"the character {line[pos]!r}")
        if m.lastgroup not in ("ws", "comment"):
            out.append((m.lastgroup, m.group()))
        pos = m.end()
    return out


def _statements(text: str) -> list[tuple[int, list[tuple[str, str]]]]:
    """(first line number, tokens) per definition or directive; a line starting with `|` continues the last."""
    out: list[tuple[int, list]] = []
    for number, line in enumerate(text.splitlines(), 1):
        tokens = _tokens(line, number)
        if not tokens:
            continue
        if tokens[0] == ("op", "|"):
            if not out:
                raise _refuse(f"line {number}", "an alternative '|' before any rule")
            out[-1][1].extend(tokens)
        else:
            out.append((number, tokens))
    return out


@functools.lru_cache(maxsize=64)
def lark_to_ebnf(text: str) -> str:
    """The EBNF (root rule `root`) of a Lark grammar in the common subset; UserInputError naming the rule and
    the construct otherwise. Cached: a request's grammar is converted when checked and again when admitted."""
    rules: dict[str, str] = {}  # Lark name -> EBNF body
    imported: dict[str, str] = {}  # local name -> common terminal
    used: dict[str, str] = {}  # referenced name -> first rule referencing it
    for number, tokens in _statements(text):
        if tokens[0] == ("op", "%"):
            _directive(tokens, number, imported)
            continue
        name, body = _RuleParser(tokens, number, used).definition()
        if name in rules or name in imported:
            raise UserInputError(f"Lark grammar, rule {name!r}: defined twice")
        rules[name] = body
    for name, rule in used.items():
        if name not in rules and name not in imported:
            hint = f" (Lark's common.lark has it: %import common.{name})" if name in COMMON else ""
            raise UserInputError(f"Lark grammar, rule {rule!r}: {name!r} is used but not defined{hint}")
    if "start" not in rules:
        raise UserInputError(f"Lark grammar: no 'start' rule (it becomes EBNF's root; {SUBSET})")
    rename = _renames(set(rules) | set(imported))
    lines = [f"{rename.get(n, n)} ::= {_rename_refs(body, rename)}" for n, body in rules.items()]
    lines += [f"{rename.get(n, n)} ::= {COMMON[c]}" for n, c in imported.items()]
    return "\n".join(lines) + "\n"


def _renames(names: set[str]) -> dict[str, str]:
    """start -> root, and a Lark rule that was itself named `root` to a free name."""
    rename = {"start": "root"}
    if "root" in names:
        free = next(f"root_{i}" for i in range(len(names) + 1) if f"root_{i}" not in names)
        rename["root"] = free
    return rename


def _rename_refs(body: str, rename: dict[str, str]) -> str:
    """`body` with each rule reference (a `\\x00name\\x00` mark) replaced by its EBNF name."""
    return re.sub("\x00(\\w+)\x00", lambda m: rename.get(m.group(1), m.group(1)), body)


def _directive(tokens: list[tuple[str, str]], number: int, imported: dict[str, str]) -> None:
    """%import common.X [-> Y] and %import common (X, Y) into `imported`; anything else refused."""
    texts = [t for _, t in tokens]
    where = f"line {number}"
    if texts[1:2] == ["ignore"]:
        raise _refuse(where, "%ignore (xgrammar has no ignored tokens: write the whitespace into the rules, "
                             "e.g. WS? between items)")
    if texts[1:4] != ["import", "common", "."] and texts[1:4] != ["import", "common", "("]:
        raise _refuse(where, f"'%{' '.join(texts[1:2])} {''.join(texts[2:])}' (only %import common.X, "
                             f"from Lark's common.lark)")
    if texts[3] == ".":
        names = texts[4:5]
        alias = texts[6] if texts[5:6] == ["->"] and len(texts) == 7 else None
        if len(texts) != 5 and alias is None:
            raise _refuse(where, f"the import '%{texts[1]} {''.join(texts[2:])}'")
        pairs = [(alias or names[0], names[0])] if names else []
    else:
        if texts[-1] != ")":
            raise _refuse(where, f"the import '%{texts[1]} {''.join(texts[2:])}'")
        pairs = [(n, n) for n in texts[4:-1] if n != ","]
    for local, name in pairs:
        if name not in COMMON:
            raise _refuse(where, f"%import common.{name} (the common terminals converted: {', '.join(COMMON)})")
        imported[local] = name


class _RuleParser:
    """One definition's tokens -> (Lark name, EBNF body); references are marked `\\x00name\\x00`."""

    def __init__(self, tokens: list[tuple[str, str]], number: int, used: dict[str, str]):
        self.tokens, self.pos, self.used = tokens, 0, used
        self.rule = f"line {number}"

    def peek(self) -> str | None:
        return self.tokens[self.pos][1] if self.pos < len(self.tokens) else None

    def take(self) -> tuple[str, str]:
        if self.pos >= len(self.tokens):
            raise self.refuse("a definition that ends early")
        self.pos += 1
        return self.tokens[self.pos - 1]

    def refuse(self, what: str) -> UserInputError:
        return _refuse(self.rule if self.rule.startswith("line") else f"rule {self.rule!r}", what)

    def definition(self) -> tuple[str, str]:
        if self.peek() in ("?", "!"):
            self.take()
        kind, name = self.take()
        if kind != "name":
            raise self.refuse(f"{name!r} where a rule name belongs (Lark rules read `name: ...`)")
        self.rule = name
        if self.peek() in (".", "{"):
            raise self.refuse("a priority (NAME.2)" if self.peek() == "." else "a template rule (name{x})")
        if self.take()[1] != ":":
            raise self.refuse(f"the definition line (expected `{name}: ...`)")
        body = self.expansions()
        if self.peek() is not None:
            raise self.refuse(f"{self.peek()!r} here")
        return name, body

    def expansions(self) -> str:
        alternatives = [self.alias()]
        while self.peek() == "|":
            self.take()
            alternatives.append(self.alias())
        return " | ".join(alternatives)

    def alias(self) -> str:
        items = []
        while self.peek() not in (None, "|", ")", "]", "->"):
            items.append(self.expr())
        if self.peek() == "->":  # `a b -> name` names the tree node; the language is unchanged
            self.take()
            if self.take()[0] != "name":
                raise self.refuse("an alias that is not a name")
        return " ".join(items) or '""'

    def expr(self) -> str:
        atom = self.atom()
        op = self.peek()
        if op in ("*", "+", "?"):
            self.take()
            return atom + op
        if op == "~":
            self.take()
            low = high = self.number()
            if self.peek() == "..":
                self.take()
                high = self.number()
            return f"{atom}{{{low},{high}}}"
        return atom

    def number(self) -> str:
        kind, text = self.take()
        if kind != "number":
            raise self.refuse(f"{text!r} after '~' (expected a count)")
        return text

    def atom(self) -> str:
        kind, text = self.take()
        if text in ("(", "["):
            inner = self.expansions()
            closer = ")" if text == "(" else "]"
            if self.take()[1] != closer:
                raise self.refuse(f"an unclosed {text!r}")
            return f"({inner})" + ("?" if text == "[" else "")
        if kind == "string":
            return self.string(text)
        if kind == "regex":
            return regex_class(text, self.refuse)
        if kind == "name":
            self.used.setdefault(text, self.rule)
            return f"\x00{text}\x00"
        raise self.refuse(f"{text!r} here")

    def string(self, text: str) -> str:
        value = _decode(text.removesuffix("i") if text.endswith("i") else text, self.refuse)
        if self.peek() == "..":
            self.take()
            kind, end = self.take()
            high = _decode(end, self.refuse) if kind == "string" else ""
            if len(value) != 1 or len(high) != 1:
                raise self.refuse(f"the range {text}..{end} (a range is two one-character strings)")
            return f"[{class_char(value)}-{class_char(high)}]"
        if text.endswith("i"):
            return "(" + " ".join(_either_case(c) for c in value) + ")" if value else '""'
        return json.dumps(value, ensure_ascii=False)


def _decode(text: str, refuse) -> str:
    try:
        with warnings.catch_warnings():  # "\\q" stays a backslash and q, in Lark as in Python (which warns)
            warnings.simplefilter("ignore")
            value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        raise refuse(f"the string {text} (an invalid escape)") from None
    if not isinstance(value, str):
        raise refuse(f"the string {text}")
    return value


def _either_case(c: str) -> str:
    lower, upper = c.lower(), c.upper()
    if lower == upper or len(lower) != 1 or len(upper) != 1:
        return json.dumps(c, ensure_ascii=False)
    return f"[{class_char(lower)}{class_char(upper)}]"


def class_char(c: str) -> str:
    """One character as it is written inside an EBNF character class."""
    if c in "\\]-^[":
        return "\\" + c
    if c in "\n\t\r":
        return {"\n": "\\n", "\t": "\\t", "\r": "\\r"}[c]
    return f"\\x{ord(c):02x}" if ord(c) < 0x20 or ord(c) == 0x7F else c


_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v"}
_QUANTIFIER = re.compile(r"[*+?]|\{\d+(,\d*)?\}")


def regex_class(text: str, refuse) -> str:
    """A regex literal that is one character class (`[...]` or `.`) and an optional greedy quantifier, as
    EBNF; `refuse(what)` makes the error for any other regex or any flag. `\\d`, `\\w` and `\\s` are refused:
    in Lark (Python's re) they match Unicode digits, letters and spaces, which no short EBNF class spells."""
    body, flags = text[1:text.rindex("/")], text[text.rindex("/") + 1:]
    what = f"the regex {text} (only a character class like /[0-9]+/ or /[a-z]/ converts to EBNF)"
    if re.search(r"\\[dwsDWS]", body):
        what = f"the regex {text} (\\d, \\w and \\s match Unicode in Lark: write a class like /[0-9]+/)"
    if flags:
        raise refuse(f"the regex flags {flags!r} of {text} (only a character class like /[0-9]+/ without "
                     f"flags converts to EBNF)")
    try:
        negated, items, end = _regex_items(body)
    except (ValueError, IndexError):
        raise refuse(what) from None
    quantifier = body[end:]
    if quantifier and not _QUANTIFIER.fullmatch(quantifier):
        raise refuse(what)
    spelled = "".join(class_char(a) if a == b else f"{class_char(a)}-{class_char(b)}" for a, b in items)
    return f"[{'^' if negated else ''}{spelled}]{quantifier}"


def _regex_items(body: str) -> tuple[bool, list[tuple[str, str]], int]:
    """(negated, [(low, high)] ranges, end of the class in `body`); ValueError for anything but one class."""
    if body.startswith("."):
        return True, [("\n", "\n")], 1
    if not body.startswith("["):
        raise ValueError(body)
    pos, negated = 1, body[1:2] == "^"
    pos += negated
    items: list[tuple[str, str]] = []
    while body[pos] != "]" or pos == 1 + negated:
        low, pos = _regex_char(body, pos)
        high = low
        if body[pos] == "-" and body[pos + 1] != "]":
            high, pos = _regex_char(body, pos + 1)
        items.append((low, high))
    return negated, items, pos + 1


def _regex_char(body: str, pos: int) -> tuple[str, int]:
    """One (possibly escaped) character of a regex class at `pos`, and the position after it."""
    if body[pos] != "\\":
        if body[pos] == "[":
            raise ValueError("a nested set")
        return body[pos], pos + 1
    c = body[pos + 1]
    if c in _ESCAPES:
        return _ESCAPES[c], pos + 2
    if c in "xu":
        width = 2 if c == "x" else 4
        return chr(int(body[pos + 2:pos + 2 + width], 16)), pos + 2 + width
    if c.isalnum():
        raise ValueError(f"the escape \\{c}")
    return c, pos + 2
