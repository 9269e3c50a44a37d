"""The node's front door: OpenAI Chat Completions, OpenAI Responses and Anthropic Messages.

The gateway knows nothing of QUIC or peers. ``create_app`` receives its upstreams through the
narrow interface in :mod:`gateway.upstream`; ``mesh`` passes in the implementations.
"""

__version__ = "0.1.0"
