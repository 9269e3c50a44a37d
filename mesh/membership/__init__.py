"""Who belongs to the mesh and how a node proves it: pure, sans-IO.

``invite.py`` (join tokens), ``members.py`` (the member list and the mesh credentials, and their
files), ``handshake.py`` (the join/auth handshake as pure objects fed messages), ``codec.py``
(the orjson + pydantic codec for control messages, shared with gossip). The tunnel adapter that
runs the handshake on a connection is ``mesh/admission.py``.
"""
