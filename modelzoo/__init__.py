"""zoo-infer: offline batch LLM inference in the style of the Cerebras Model Zoo flow."""

__version__ = "0.1.0"
