"""The ``mesh`` command line. Each sub-module registers its commands on :data:`app`.

Heavy imports (mlx, aioquic) happen inside commands so that ``mesh --help`` stays instant.
"""

# Command modules register themselves on import; keep this list in sync with mesh/cli/*.py.
from mesh.cli import chat, lab, members, mesh_cmds, node, service, worker  # noqa: F401
from mesh.cli import models as _models  # noqa: F401
from mesh.cli.app import app, main  # noqa: F401
