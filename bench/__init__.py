"""membench: measure what PyTorch memory-saving techniques save and cost on a real training step."""

__version__ = "0.1.0"
