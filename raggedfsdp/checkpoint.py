"""Loading DCP checkpoints without unpickling arbitrary objects.

``torch.distributed.checkpoint.FileSystemReader`` loads tensors with ``weights_only=True`` but
reads the checkpoint's ``.metadata`` with plain ``pickle.load``: a crafted checkpoint runs any
code it likes the moment it is opened. ``SafeFileSystemReader`` reads that file with an
unpickler that can only build DCP's own metadata types (plus ``torch.Size``, dtypes, layouts and
paths) and refuses everything else with an error naming what it found. ``load`` is
``dcp.load`` with that reader by default.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

__all__ = ["SafeFileSystemReader", "UnsafeCheckpointError", "load"]

_METADATA = "torch.distributed.checkpoint.metadata"
_ALLOWED = {
    (_METADATA, name)
    for name in (
        "Metadata",
        "StorageMeta",
        "MetadataIndex",
        "TensorProperties",
        "TensorStorageMetadata",
        "ChunkStorageMetadata",
        "BytesStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("collections", "OrderedDict"),
}


class UnsafeCheckpointError(pickle.UnpicklingError):
    """The checkpoint's metadata asks to build something other than DCP metadata."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"checkpoint metadata refers to {module}.{name}, which is not part of DCP's metadata; "
            "refusing to unpickle it. If you trust this checkpoint, load it with "
            "torch.distributed.checkpoint.FileSystemReader instead"
        )


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose metadata is read with an allow-list unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = _MetadataUnpickler(io.BytesIO(stream.read())).load()
        if not isinstance(metadata, Metadata):
            raise UnsafeCheckpointError(
                f"{path} does not hold DCP metadata (found {type(metadata).__name__})"
            )
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def load(state_dict: dict[str, Any], path: str, **kwargs: Any) -> None:
    """``torch.distributed.checkpoint.load`` from ``path`` with the safe metadata reader."""
    dcp.load(state_dict, storage_reader=SafeFileSystemReader(path), **kwargs)
