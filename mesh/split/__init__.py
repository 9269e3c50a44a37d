"""One model across several nodes: pipeline-parallel serving on MLX distributed.

``plan`` (pure: a model's layers → ranks by each node's offered memory). The per-rank model
slice itself is the worker's (``worker/split/pipeline.py``); the mesh plans, starts and watches ranks.
"""
