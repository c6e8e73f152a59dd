"""What a gradient compression sends (`grad_compression`, runtime.grad_compression): the
fraction of the gradients' bytes its all-reduce moves, which the data-parallel sync is
priced on."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from autopart.policy import powersgd_compresses, powersgd_matrix, powersgd_rank


def gradient_fraction(spec: str | None, shapes: Iterable[torch.Size], element_size: int) -> float:
    """Bytes all-reduced under `spec` over the bytes of the gradients of `shapes` (in
    elements of `element_size` bytes): bf16 sends 2 bytes an element; PowerSGD at rank r
    sends (n + m) r elements for each n × m matrix it compresses, the rest whole."""
    shapes = list(shapes)
    whole = sum(s.numel() for s in shapes)
    if spec is None or whole == 0:
        return 1.0
    if spec == "bf16":
        return 2 / element_size
    rank = powersgd_rank(spec)
    sent = 0
    for shape in shapes:
        n, m = powersgd_matrix(shape)
        sent += (n + m) * rank if powersgd_compresses(shape, rank) else shape.numel()
    return sent / whole
