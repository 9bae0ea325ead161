"""llm-eval: the one place where the measurement protocol lives (see README.md)."""

__version__ = "0.1.0"
