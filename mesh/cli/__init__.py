"""The ``mesh`` command line. Each sub-module registers its commands on :data:`app`; other
packages add command groups through an entry point (``plugins.py``: ``mesh lab``).

Heavy imports (mlx, aioquic) happen inside commands so that ``mesh --help`` stays instant.
"""

from mesh.cli.app import app, main  # noqa: F401
from mesh.cli.plugins import add_command_groups, declared_groups

# Other packages' groups first, so `mesh --help` lists them where it always has (it lists
# groups in the order they were added).
add_command_groups(app, declared_groups())

# Command modules register themselves on import; keep this list in sync with mesh/cli/*.py.
from mesh.cli import chat, members, mesh_cmds, node, service, worker  # noqa: E402, F401
from mesh.cli import models as _models  # noqa: E402, F401
