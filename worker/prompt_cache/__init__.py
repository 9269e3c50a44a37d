"""The prefix store of KV caches and its digest (block hashes that mesh routing reads)."""
