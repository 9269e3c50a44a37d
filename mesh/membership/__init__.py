"""Who belongs to the mesh and how a node proves it: pure, sans-IO.

``facts.py`` (signed admissions and tombstones, the root of trust), ``ledger.py`` (who is a
member, derived from those facts the same way on every node), ``members.py`` (the store – the
ledger, members' addresses, invites – the mesh credentials, and their files), ``migration.py``
(a member list from before signed membership, signed once), ``invite.py`` (join tokens),
``handshake.py`` (the join/auth handshake as pure objects fed messages), ``codec.py`` (the
orjson + pydantic codec for control messages, shared with gossip). The tunnel adapter that runs
the handshake on a connection is ``mesh/admission.py``; members keep each other's facts up to
date through ``mesh/member_sync.py``.
"""
