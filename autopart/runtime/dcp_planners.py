"""torch.distributed.checkpoint planners that write and read `Piece`s (pieces.py).

A state dict for these planners maps each entry's name to either a list of this rank's
pieces of it (boxes of one whole tensor, each with the view that holds it) or any other
object (saved once, by the coordinator, as bytes). On save, each piece is one chunk of
the entry; DCP's global plan keeps one copy of a box that several ranks hold (replicas)
and checks that the chunks do not overlap. On load, DCP's resharding reads each piece's
box from whichever saved chunks overlap it, straight into the view: a checkpoint
written under one plan loads under another, and no rank reads what it does not hold.
"""

from __future__ import annotations

import io
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from autopart.runtime.pieces import Piece

PieceState = dict[str, Any]  # name -> list[Piece] | any picklable object


def _is_pieces(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(p, Piece) for p in value)


def _chunk(piece: Piece) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(offsets=torch.Size(piece.offsets), sizes=piece.view.shape)


class SavePieces(DefaultSavePlanner):
    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def create_local_plan(self) -> SavePlan:
        items = []
        for name, value in self.state_dict.items():
            if _is_pieces(value):
                items += [
                    WriteItem(
                        index=MetadataIndex(name, torch.Size(piece.offsets)),
                        type=WriteItemType.SHARD,
                        tensor_data=TensorWriteData(
                            chunk=_chunk(piece),
                            properties=TensorProperties.create_from_tensor(piece.view),
                            size=torch.Size(piece.size),
                        ),
                    )
                    for piece in value
                ]
            elif self.is_coordinator:
                items.append(WriteItem(index=MetadataIndex(name), type=WriteItemType.BYTE_IO))
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        value = self.state_dict[write_item.index.fqn]
        if write_item.type == WriteItemType.BYTE_IO:
            buffer = io.BytesIO()
            torch.save(value, buffer)
            return buffer
        offsets = tuple(write_item.index.offset or ())
        piece = next(p for p in value if p.offsets == offsets)
        return piece.view.detach().contiguous()


class LoadPieces(DefaultLoadPlanner):
    """Fills every piece's view; `objects` receives the entries saved as bytes."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.objects: dict[str, Any] = {}

    def set_up_planner(
        self,
        state_dict: PieceState,
        metadata: Metadata | None = None,
        is_coordinator: bool = False,
    ) -> None:
        self.state_dict, self.metadata, self.is_coordinator = state_dict, metadata, is_coordinator

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None, "DCP reads the metadata before planning"
        items: list[ReadItem] = []
        for name, value in self.state_dict.items():
            stored = self.metadata.state_dict_metadata[name]
            if _is_pieces(value):
                chunks = [_chunk(piece) for piece in value]
                items += create_read_items_for_chunk_list(name, stored, chunks)  # type: ignore[arg-type]
            else:
                index = MetadataIndex(name)
                zero = torch.Size((0,))
                items.append(ReadItem(LoadItemType.BYTE_IO, index, zero, index, zero, zero))
        return LoadPlan(items)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.objects[read_item.dest_index.fqn] = torch.load(value, weights_only=True)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        assert index.index is not None, "each read names the piece it fills"
        return self.state_dict[index.fqn][index.index].view
