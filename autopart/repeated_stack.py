"""The model's main repeated stack, found on the module tree before capture.

A stack is an `nn.ModuleList` or `nn.Sequential` whose children are copies of one
block: the same classes, the same parameters and buffers (names, shapes, dtypes) and
the same plain settings, a layer's own index aside. Planning needs only enough copies
to see how one block hands over to the next (`shortened`); the graph of the rest is
built from them (`stack_expansion`).
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from torch import nn

# The copies a shortened capture keeps: the first block (which may compute what all
# later blocks share), then two more, so that the third shows what a block reads from
# the one before it as distinct from what it reads from the first.
KEPT = 3
_SETTINGS = (bool, int, float, str, type(None))


@dataclass(frozen=True)
class Stack:
    """A container of `length` copies of one block, at module path `path`."""

    path: str
    length: int

    def block(self, index: int) -> str:
        """The module path of the block at `index`."""
        return f"{self.path}.{index}" if self.path else str(index)

    def renamer(self, index: int) -> Callable[[str], str]:
        """Rewrites a module path (or a key naming one) in the last kept block to the
        same path in the block at `index`."""
        kept = re.compile(re.escape(self.block(KEPT - 1)) + r"(?=\.|$|')")
        return functools.partial(kept.sub, self.block(index))


def main_stack(model: nn.Module) -> Stack | None:
    """The container with the most copies of one block, where shortening it to `KEPT`
    copies saves a capture; None where there is none, or where a block shares a
    parameter with anything else (a tied weight would not be copied faithfully)."""
    best: Stack | None = None
    for path, module in model.named_modules():
        if not isinstance(module, nn.ModuleList | nn.Sequential) or len(module) <= KEPT:
            continue
        if (best is None or len(module) > best.length) and _alike(list(module)):
            best = Stack(path, len(module))
    if best is None or _shares_parameters(model, model.get_submodule(best.path)):
        return None
    return best


def _alike(blocks: list[nn.Module]) -> bool:
    """Whether `blocks` are copies of one block: what a block's forward can depend on
    beyond its inputs (its modules' classes and plain settings, its tensors' names,
    shapes and dtypes) is the same in each, but for a setting that counts the blocks
    (`layer_idx`: 0, 1, 2, ...), which the trace does not read."""
    first = _structure(blocks[0])
    if any(_structure(b) != first for b in blocks[1:]):
        return False
    settings = [_settings(b) for b in blocks]
    if any(s.keys() != settings[0].keys() for s in settings[1:]):
        return False
    return all(
        len({s[key] for s in settings}) == 1
        or [s[key] for s in settings] == list(range(len(blocks)))
        for key in settings[0]
    )


def _structure(block: nn.Module) -> tuple:
    modules = tuple((name, type(m)) for name, m in block.named_modules(remove_duplicate=False))
    tensors = tuple(
        (name, tuple(t.shape), t.dtype, t.requires_grad)
        for name, t in [*block.named_parameters(), *block.named_buffers()]
    )
    return modules, tensors


def _settings(block: nn.Module) -> dict[tuple[str, str], object]:
    return {
        (name, k): v
        for name, m in block.named_modules(remove_duplicate=False)
        for k, v in vars(m).items()
        if not k.startswith("_") and type(v) in _SETTINGS
    }


def _shares_parameters(model: nn.Module, stack: nn.Module) -> bool:
    inside = {id(p) for p in stack.parameters()}
    count: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        count[id(p)] = count.get(id(p), 0) + 1
    return any(count[i] > 1 for i in inside)


@contextlib.contextmanager
def shortened(model: nn.Module, stack: Stack) -> Iterator[None]:
    """`model` with its stack cut to its first `KEPT` blocks while in the context."""
    container = model.get_submodule(stack.path)
    children = container._modules
    kept = dict(list(children.items())[:KEPT])
    container._modules = kept
    try:
        yield
    finally:
        container._modules = children
