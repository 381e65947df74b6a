"""Which sizes of a traced value the forward read: the tracer folds sizes to constants (``h * h.shape[-1] ** 0.5`` is
``h * 11.3`` in the graph), so a read is noted on the value's node instead, for `fxrewrite.patterns.feature_path`
(a size along an axis that tensor parallelism splits is another number on each rank)."""

from __future__ import annotations

import torch
import torch.fx as fx

__all__ = ["LoggedSize", "note_size_read"]


class LoggedSize(tuple):
    """The shape of a traced value (its sizes are constants in the graph) that notes in its node's
    ``meta["size_reads"]`` the axes the forward reads: `fxrewrite.patterns.feature_path` refuses to shard when a size
    along a split axis was read (each rank would see its own share: ``h * h.shape[-1] ** 0.5`` folds to a constant).
    A tuple (torch.Size cannot be subclassed) with torch.Size's `numel`; slices are torch.Size."""

    def __new__(cls, size, node: fx.Node):
        obj = super().__new__(cls, size)
        obj.node = node
        return obj

    def numel(self) -> int:
        self.note(range(len(self)))
        return torch.Size(tuple.__iter__(self)).numel()

    def note(self, axes) -> None:
        self.node.meta.setdefault("size_reads", set()).update(axes)

    def __getitem__(self, index):
        axes = range(len(self))[index]
        self.note(axes if isinstance(index, slice) else [axes])
        part = tuple.__getitem__(self, index)
        return torch.Size(part) if isinstance(index, slice) else part

    def __iter__(self):
        self.note(range(len(self)))
        return tuple.__iter__(self)


def note_size_read(node: fx.Node, method: str, args: tuple, val):
    """`val`, the static result of ``x.size(...)`` / ``x.numel()`` on the traced value of `node`, with the axes it
    read noted (`LoggedSize`)."""
    ndim = getattr(node.meta.get("val"), "ndim", None)
    if ndim is None:
        return val
    if method == "size" and not args and isinstance(val, torch.Size):
        return LoggedSize(val, node)
    axes = range(ndim) if method == "numel" or not args else [args[0] % ndim]
    node.meta.setdefault("size_reads", set()).update(axes)
    return val
