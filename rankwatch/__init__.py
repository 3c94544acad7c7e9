"""rankwatch: a debugging agent for distributed PyTorch training."""

__version__ = "0.1.0"
