"""The owner thread that puts jobs onto mlx-lm's generator: the Engine and the collaborators it
composes (running rows, shared-prefill followers, prompt-cache commits), what goes in and out of
it (types), loading, the one-at-a-time generator and the loop guard. It takes token ids."""
