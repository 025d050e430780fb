"""Trainer-side client for PyTorch."""

from overlord.torch.dataloader import DataLoader
from overlord.torch.digest import batch_digest

__all__ = ["DataLoader", "batch_digest"]
