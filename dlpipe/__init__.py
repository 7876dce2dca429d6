"""dlpipe: a declarative, hardware-aware PyTorch training launcher."""
__version__ = "0.1.0"
