"""Structured output in the worker: JSON schemas compiled to grammars that mask the logits."""
