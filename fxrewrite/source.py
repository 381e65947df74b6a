"""Edit a class's `forward` source with libcst and compile the result for one instance.

`ForwardSource.recover(cls)` finds the source of ``cls.forward`` (decorators included) in its
real file; patterns edit `ForwardSource.tree` with the helpers here (`unique_self_call`,
`enclosing_statement`, `replace`...); `compile_forward` turns the edited tree into a function
compiled in the original module's globals, with line numbers that point at the real file, and
`fxrewrite.bound_forward.bind` attaches it to one instance (the class and its other instances are untouched).
Formatting and comments survive because libcst round-trips source exactly.
Knows no pattern (design rule: source never imports patterns).
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import textwrap
import types

import libcst as cst

from fxrewrite.bound_forward import ForwardRecipe, remember


class SourceError(ValueError):
    """The source cannot be edited safely; the message says why (it lands in the report)."""


@dataclasses.dataclass
class ForwardSource:
    """Where `cls.forward` lives and its parsed source."""

    cls: type
    """The class whose `forward` this is (the defining class, for zero-argument `super()`)."""
    filename: str
    first_lineno: int
    """Line of the first decorator (or `def`) in `filename`."""
    globals: dict
    """The defining module's namespace: the edited function resolves names in it."""
    original: str
    """Dedented source text of the function, decorators included."""
    tree: cst.Module
    """Parsed `original`; patterns replace it with edited trees."""

    @classmethod
    def recover(cls, module_cls: type) -> "ForwardSource":
        """Recover ``module_cls.forward``'s source. SourceError when it is not available."""
        fn = inspect.unwrap(module_cls.forward)
        owner = next((k for k in module_cls.__mro__ if "forward" in k.__dict__), module_cls)
        try:
            lines, lineno = inspect.getsourcelines(fn)
            filename = inspect.getsourcefile(fn)
        except (OSError, TypeError) as e:
            raise SourceError(f"source of {module_cls.__name__}.forward not available: {e}") from e
        text = textwrap.dedent("".join(lines))
        try:
            tree = cst.parse_module(text)
        except cst.ParserSyntaxError as e:
            raise SourceError(f"cannot parse {module_cls.__name__}.forward: {e}") from e
        _check_recompilable(module_cls, fn, tree)
        return cls(owner, filename, lineno, fn.__globals__, text, tree)

    @property
    def function(self) -> cst.FunctionDef:
        return function_def(self.tree)

    def diff(self, tree: cst.Module | None = None) -> str:
        """Unified diff between the original forward and `tree` (default: the current tree)."""
        new = (tree or self.tree).code
        label = f"{self.filename}:{self.first_lineno} {self.cls.__qualname__}.forward"
        return "".join(difflib.unified_diff(self.original.splitlines(True), new.splitlines(True),
                                            fromfile=f"{label} (original)", tofile=f"{label} (fxrewrite)"))


def _check_recompilable(module_cls: type, fn, tree: cst.Module) -> None:
    """SourceError when the source, compiled again by `compile_forward`, would not mean the same.

    * Free variables other than ``__class__`` (a forward defined inside a function, reading that
      function's locals): the recompiled function would look those names up in the module's
      globals instead, and silently read other values (or none).
    * Private names (``self.__x``, ``__x``): Python mangles them to ``_Class__x`` only inside a
      class body, so the recompiled function would read a different attribute.
    """
    free = [v for v in fn.__code__.co_freevars if v != "__class__"]
    if free:
        raise SourceError(f"{module_cls.__name__}.forward reads closure variable(s) {', '.join(free)}: "
                          "recompiled source would resolve them as globals")
    private = sorted(_private_names(tree))
    if private:
        raise SourceError(f"{module_cls.__name__}.forward uses name-mangled private name(s) "
                          f"{', '.join(private)}: recompiled outside the class they would not be mangled")


def _private_names(tree: cst.Module) -> set[str]:
    """Identifiers Python would mangle in a class body: ``__x`` not ending in ``__``."""
    found: set[str] = set()

    class V(cst.CSTVisitor):
        def visit_Name(self, node):
            if node.value.startswith("__") and not node.value.endswith("__"):
                found.add(node.value)

    tree.visit(V())
    return found


def function_def(tree: cst.Module) -> cst.FunctionDef:
    for stmt in tree.body:
        if isinstance(stmt, cst.FunctionDef):
            return stmt
    raise SourceError("no function definition in source")


class _Collector(cst.CSTVisitor):
    """One walk: parent links (by identity), self.<attr>(...) calls, names used."""

    def __init__(self) -> None:
        self.parents: dict[int, cst.CSTNode] = {}
        self.stack: list[cst.CSTNode] = []
        self.self_calls: dict[str, list[cst.Call]] = {}
        self.names: set[str] = set()

    def on_visit(self, node: cst.CSTNode) -> bool:
        if self.stack:
            self.parents[id(node)] = self.stack[-1]
        self.stack.append(node)
        if isinstance(node, cst.Name):
            self.names.add(node.value)
        attr = self_attribute(node.func) if isinstance(node, cst.Call) else None
        if attr is not None:
            self.self_calls.setdefault(attr, []).append(node)
        return True

    def on_leave(self, original_node: cst.CSTNode) -> None:
        self.stack.pop()


def self_attribute(expr: cst.BaseExpression) -> str | None:
    """'x' for the expression `self.x`, else None."""
    if isinstance(expr, cst.Attribute) and isinstance(expr.value, cst.Name) and expr.value.value == "self":
        return expr.attr.value
    return None


def collect(tree: cst.Module) -> _Collector:
    collector = _Collector()
    tree.visit(collector)
    return collector


def unique_self_call(tree: cst.Module, attr: str, info: _Collector | None = None) -> cst.Call:
    """The one call `self.<attr>(...)` in the source; SourceError if there are none or several."""
    calls = (info or collect(tree)).self_calls.get(attr, [])
    if len(calls) != 1:
        raise SourceError(f"self.{attr}(...) appears {len(calls)} times in forward, expected exactly once")
    return calls[0]


def parent(info: _Collector, node: cst.CSTNode) -> cst.CSTNode | None:
    return info.parents.get(id(node))


def enclosing_statement(info: _Collector, node: cst.CSTNode) -> tuple[cst.SimpleStatementLine, cst.CSTNode]:
    """The simple statement line holding `node` and the block (body owner) it sits in.

    SourceError when `node` is inside a lambda, comprehension or nested function, where moving or
    merging code would change when it runs.
    """
    current = node
    while current is not None and not isinstance(current, cst.SimpleStatementLine):
        if isinstance(current, (cst.Lambda, cst.ListComp, cst.SetComp, cst.DictComp, cst.GeneratorExp,
                                cst.IfExp, cst.BooleanOperation)):
            raise SourceError("call sits inside a lambda, comprehension or conditional expression")
        current = parent(info, current)
    if current is None:
        raise SourceError("call is not inside a simple statement")
    block = parent(info, current)
    return current, block


def block_statements(block: cst.CSTNode) -> list:
    """The statements of an IndentedBlock or Module."""
    return list(block.body)


def assigned_names(stmt: cst.CSTNode) -> set[str]:
    """Names a statement (or anything nested in it) binds: assignment/for/with targets, imports."""
    found: set[str] = set()

    class V(cst.CSTVisitor):
        def visit_AssignTarget(self, node):
            found.update(_names(node.target))

        def visit_AugAssign(self, node):
            found.update(_names(node.target))

        def visit_AnnAssign(self, node):
            found.update(_names(node.target))

        def visit_For(self, node):
            found.update(_names(node.target))

        def visit_AsName(self, node):
            found.update(_names(node.name))

        def visit_NamedExpr(self, node):
            found.update(_names(node.target))

    stmt.visit(V())
    return found


def _names(expr: cst.CSTNode) -> set[str]:
    out: set[str] = set()

    class V(cst.CSTVisitor):
        def visit_Name(self, node):
            out.add(node.value)

    expr.visit(V())
    return out


def line_count(tree: cst.Module, node: cst.CSTNode) -> int:
    """Lines `node` takes in the generated code (its leading comment lines included)."""
    return tree.code_for_node(node).count("\n")


def compile_forward(src: ForwardSource, tree: cst.Module) -> types.FunctionType:
    """Compile the edited function in the original module's globals (:meth:`ForwardRecipe.compile`: tracebacks
    point at the real file, zero-argument ``super()`` works, decorators are applied again)."""
    recipe = ForwardRecipe(src.cls, src.filename, src.first_lineno, src.globals.get("__name__", ""),
                           src.function.name.value, tree.code)
    return remember(recipe, recipe.compile(src.globals))


def check_not_rebound(block: cst.CSTNode, first: cst.CSTNode, last: cst.CSTNode, name: str) -> None:
    """SourceError if a statement from `first` up to (not including) `last` binds `name`."""
    body = block_statements(block)
    i, j = _index(body, first), _index(body, last)
    for stmt in body[i:j]:
        if name in assigned_names(stmt):
            raise SourceError(f"{name!r} is reassigned between the calls to fuse")


def _index(body: list, stmt: cst.CSTNode) -> int:
    for i, s in enumerate(body):
        if s is stmt:
            return i
    raise SourceError("statement not found in its block")


def same_block_index(info: _Collector, calls: list[cst.Call]) -> tuple[cst.CSTNode, list]:
    """The common block of the statements holding `calls` and those statements in block order.

    SourceError when the calls sit in different blocks (e.g. one under an `if`).
    """
    lines = [enclosing_statement(info, c) for c in calls]
    blocks = {id(b) for _, b in lines}
    if len(blocks) != 1:
        raise SourceError("the calls to fuse are in different blocks")
    block = lines[0][1]
    body = block_statements(block)
    ordered = sorted({id(s): s for s, _ in lines}.values(), key=lambda s: _index(body, s))
    return block, ordered


def replace_many(tree: cst.Module, replacements: dict[int, object]) -> cst.Module:
    """One pass replacing nodes by identity: {id(old): new node, or callable(updated_old) -> new}."""

    class T(cst.CSTTransformer):
        def on_leave(self, original_node, updated_node):
            new = replacements.get(id(original_node))
            if new is None:
                return updated_node
            return new(updated_node) if callable(new) else new

    return tree.visit(T())


def with_statement_before(code: str):
    """A `replace_many` value for a statement line: run the small statement `code` just before it, keeping the
    forward's line numbers (tracebacks point at the real file). It takes the line's last blank leading line
    when it has one (transformers' forwards usually do), else it goes first on the line (``a = ...; <line>``)."""
    new_stmt = cst.parse_statement(code + "\n").body[0]

    def edit(line):
        leading = list(line.leading_lines)
        blank = max((i for i, e in enumerate(leading) if e.comment is None), default=None)
        if blank is None:
            joined = new_stmt.with_changes(semicolon=cst.Semicolon(whitespace_after=cst.SimpleWhitespace(" ")))
            return line.with_changes(body=[joined] + list(line.body))
        own = cst.SimpleStatementLine(body=[new_stmt], leading_lines=leading[:blank])
        return cst.FlattenSentinel([own, line.with_changes(leading_lines=leading[blank + 1:])])

    return edit
