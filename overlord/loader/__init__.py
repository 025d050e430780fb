"""Source Loaders: one owner of each source partition's file state."""

from overlord.loader.order import EpochOrder, RowGroups
from overlord.loader.source_loader import Prepared, SourceLoader, stream_name

__all__ = [
    "EpochOrder",
    "Prepared",
    "RowGroups",
    "SourceLoader",
    "stream_name",
]
