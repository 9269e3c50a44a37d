"""The Linux CPU fast path: OpenBLAS preloaded, weights in float32, attention in numpy."""
