"""globalbatch: the global batch size of PyTorch training, planned, exact and measured."""

__version__ = "0.1.0"
