"""The MLX worker: model store (pull, convert, list), engine, output parsing and its HTTP app.

Imports nothing from ``gateway`` or ``mesh``.
"""
