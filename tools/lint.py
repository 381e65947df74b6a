"""Size check from STYLE.md: files over 400 lines and functions over 60 lines, in the package folders.

Exit status 1 when anything is over; prints one line per finding (path:line name length).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("fxrewrite", "patterns", "kernels", "runtime", "benchmarks")
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60


def findings(path: Path) -> list[str]:
    text = path.read_text()
    rel = path.relative_to(ROOT)
    out = []
    n = text.count("\n") + 1
    if n > MAX_FILE_LINES:
        out.append(f"{rel}: {n} lines (cap {MAX_FILE_LINES})")
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                out.append(f"{rel}:{node.lineno} {node.name}: {length} lines (cap {MAX_FUNCTION_LINES})")
    return out


def main() -> int:
    found = [f for d in FOLDERS for p in sorted((ROOT / d).rglob("*.py")) for f in findings(p)]
    print("\n".join(found) or "sizes ok")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
