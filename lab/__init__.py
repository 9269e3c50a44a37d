"""The lab: a probe that measures a live gateway, and a fault lab that runs a mesh of local nodes
through chaos proxies while the probe runs.

Modules: ``rows`` (the probe's row schema), ``sse`` (byte-level SSE framing), ``wire`` (request
bodies and stream readers per client API), ``stats`` / ``report`` / ``plots`` (summaries),
``probe`` (the async runner and its CLI), ``scenario`` (fault scenarios from TOML),
``verdict`` (judging a scenario run), ``procs`` (process groups and clean-up), ``netlab``
(the scenario runner), ``cli`` (``mesh lab``: the mesh command line finds it by entry point, so
the lab imports mesh and never the other way round).
"""
