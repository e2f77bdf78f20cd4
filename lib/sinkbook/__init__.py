"""sinkbook: hook utilities and analyses for attention sinks in transformer language models."""

__version__ = "0.1.0"
