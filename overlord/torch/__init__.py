"""Trainer-side client for PyTorch."""

from overlord.torch.dataloader import DataLoader

__all__ = ["DataLoader"]
