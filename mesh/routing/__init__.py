"""Routing by prefix and load: digests in, ranked routes (and hedges) out (issue 25)."""
