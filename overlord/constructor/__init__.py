"""Data Constructors: micro-batch transforms per data-parallel group."""

from overlord.constructor.packing import pack, pad

__all__ = [
    "pack",
    "pad",
]
