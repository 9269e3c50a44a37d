"""A worker's side of split serving: one model's layers over the ranks of an MLX ring."""
