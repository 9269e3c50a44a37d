"""The MLX worker, in rooms a request travels through top-down: serve/ (process, HTTP) → chat/
(request → job → wire) → engine/ (owner thread, batch) → speculative/, prompt_cache/, cpu/,
split/; tools/, structured/, convert/ beside them; the store, pull, sampling and the mlx-lm
seam at the ground.

Imports nothing from ``gateway`` or ``mesh``.
"""

from worker.mlx_lm_hooks import import_within_open_files_limit

# Before any of our modules imports mlx-lm: its import fails under a low open-files limit.
import_within_open_files_limit()
