"""One module per client API: parse its body into a ``ChatRequest`` and encode internal events
into its wire format (stream frames or a whole body)."""
