"""Tool calling in the worker: the prompt that lists tools, and tool calls parsed out of text."""
