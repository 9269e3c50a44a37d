"""Speculative decoding: drafts (prompt lookup or a small model) verified in one forward pass
inside the batch; the pure per-row policy and step costs; the batch cache operations a verify
pass needs and the masked holes it leaves."""
