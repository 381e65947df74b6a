"""FusionReport: what `optimize` fused per module class, what it refused and why, and the source diffs."""

from __future__ import annotations

import dataclasses
import textwrap

from torch import nn

REPORT_ATTR = "_fxrewrite_report"
"""The attribute of an optimized model holding its `FusionReport`."""


@dataclasses.dataclass
class ClassReport:
    """One module class of the model."""

    name: str
    """Class name (qualified by its module's short name when ambiguous)."""
    instances: int = 0
    applied: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    """pattern name -> {description: number of instances it was applied to}."""
    present: list[str] = dataclasses.field(default_factory=list)
    """Fusions the model already has ("qkv: qkv_proj (already fused)")."""
    skipped: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    """(pattern or "trace"/"source", reason) for every refusal."""
    diff: str = ""
    """Unified diff of the rewritten forward (empty when the source was not edited)."""
    replaced_with: str = ""
    """Set when instances went with the module holding them: "inside model.layers.0.mlp and 1 more, now FusedMoE"
    (or "1 of 2 inside ..."); when none is left, the refusals of the class's own patterns are moot and dropped."""

    def skip(self, what: str, reason: str) -> None:
        if (what, reason) not in self.skipped:
            self.skipped.append((what, reason))


class GroupReport:
    """A `ClassReport` as one group of its instances sees it (`fxrewrite.compiler` traces and judges each
    group of identical instances on its own): refusals name the group's modules, the rest is shared."""

    def __init__(self, entry: ClassReport, names: list[str]) -> None:
        label = names[0] if len(names) == 1 else f"{names[0]} and {len(names) - 1} more"
        self.__dict__.update(entry=entry, label=label, seen=set())

    def skip(self, what: str, reason: str) -> None:
        self.seen.add(what)
        self.entry.skip(what, f"[{self.label}] {reason}")

    def __getattr__(self, name: str):
        return getattr(self.entry, name)

    def __setattr__(self, name: str, value) -> None:
        setattr(self.entry, name, value)


ATTENTION_NOTE = "attention: "
"""How the note on the attention implementation `optimize` chose begins (followed by the implementation's name)."""


@dataclasses.dataclass
class FusionReport:
    """Result of `fxrewrite.optimize`; `str(report)` is a table, `report.diff()` the source diffs."""

    classes: dict[str, ClassReport] = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)
    """Model-wide notes (e.g. the meta recording run stopped early)."""

    def entry(self, name: str) -> ClassReport:
        return self.classes.setdefault(name, ClassReport(name))

    def applied_patterns(self) -> list[str]:
        """Sorted names of the patterns applied to at least one instance."""
        return sorted({p for c in self.classes.values() for p in c.applied})

    def present_patterns(self) -> list[str]:
        """Sorted names of patterns the model already had fused."""
        return sorted({p.split(":")[0] for c in self.classes.values() for p in c.present})

    def skipped(self) -> list[tuple[str, str, str]]:
        """(class, pattern, reason) for every refusal."""
        return [(c.name, p, r) for c in self.classes.values() for p, r in c.skipped]

    def __str__(self) -> str:
        rows = [("module class", "instances", "applied", "skipped (reason)")]
        for c in self.classes.values():
            applied = [f"{p}: {d}" + (f" x{n}" if n != c.instances else "")
                       for p, descs in c.applied.items() for d, n in descs.items()]
            applied += [f"({c.replaced_with})"] if c.replaced_with else []
            applied = "\n".join(applied + c.present) or "-"  # one fusion per line
            skipped = "\n".join(f"{p}: {r}" for p, r in c.skipped) or "-"
            rows.append((c.name, str(c.instances), applied, skipped))
        lines = format_table(rows, max_widths=(48, 9, 60))
        lines.insert(1, "-" * min(max(len(line) for line in lines), 140))
        return "\n".join(lines + [f"note: {n}" for n in self.notes])

    def diff(self) -> str:
        """Unified diffs of every rewritten forward, original vs new."""
        return "".join(c.diff for c in self.classes.values() if c.diff)


def format_table(rows: list[tuple[str, ...]], max_widths: tuple[int, ...]) -> list[str]:
    """Text lines of a table whose columns stay aligned: column i is as wide as its longest line, at most
    max_widths[i]; a cell's lines ("\n") start lines of its own column, and a longer line wraps onto
    continuation lines (at spaces; a long name is cut). The last column is not padded or wrapped."""
    last = len(rows[0]) - 1
    widths = [min(max(len(line) for r in rows for line in r[i].split("\n")), max_widths[i]) for i in range(last)]
    lines = []
    for row in rows:
        cells = [_wrap(cell, widths[i]) for i, cell in enumerate(row[:last])] + [row[last].split("\n")]
        for k in range(max(len(c) for c in cells)):
            parts = [(c[k] if k < len(c) else "").ljust(widths[i]) for i, c in enumerate(cells[:last])]
            lines.append("  ".join(parts + [cells[last][k] if k < len(cells[last]) else ""]).rstrip())
    return lines


def _wrap(cell: str, width: int) -> list[str]:
    return [part for line in cell.split("\n")
            for part in ([line] if len(line) <= width else textwrap.wrap(line, width, break_on_hyphens=False) or [line])]


def explain(model: nn.Module) -> FusionReport:
    """The `FusionReport` of a model passed through `optimize`. TypeError for a non-module (a path: the CLI's
    `fxrewrite explain MODEL` takes those), ValueError for a module `optimize` has not seen."""
    if not isinstance(model, nn.Module):
        hint = " (for a model folder or hub id use the CLI: fxrewrite explain MODEL)" if isinstance(model, str) else ""
        raise TypeError(f"explain expects the nn.Module fxrewrite.optimize returned, got {type(model).__name__} "
                        f"{model!r:.80}{hint}")
    report = getattr(model, REPORT_ATTR, None)
    if report is None:
        raise ValueError(f"{type(model).__name__} has not been passed through fxrewrite.optimize")
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    stale = [n for n in report.notes if n.startswith(ATTENTION_NOTE) and not n.startswith(f"{ATTENTION_NOTE}{impl} ")]
    if not stale:
        return report
    # set_attn_implementation(...) after optimize (the Trainer's context parallelism wants "sdpa"): say so
    notes = [f"{n}; now {impl!r}, set after optimize" if n in stale else n for n in report.notes]
    return dataclasses.replace(report, notes=notes)
