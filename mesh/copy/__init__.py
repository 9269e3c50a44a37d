"""Peer copy: members give each other stored models over a TLS 1.3 side channel.

``manifest`` (what a model is: files, sizes, SHA-256 per file and per chunk), ``protocol`` (the
wire frames, pure), ``tls`` (contexts whose only trust anchors are members' certificates),
``server`` (serves manifests and chunks to members) and ``client`` (fetches by chunk from one or
several members, verifies each chunk as it streams in, resumes, renames into the store when
every chunk of every file verified).
"""
