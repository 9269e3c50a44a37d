"""The MLX worker, in rooms a request travels through top-down: serve/ (process, HTTP) → chat/
(request → job → wire) → engine/ (owner thread, batch) → speculative/, prompt_cache/, cpu/,
split/; tools/, structured/, convert/ beside them; the store, pull, sampling and the mlx-lm
seam at the ground.

Imports nothing from ``gateway`` or ``mesh``.
"""
