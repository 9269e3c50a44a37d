"""``python -m worker --model X --port N``: see worker/serve_main.py."""

import sys

from worker.serve_main import main

sys.exit(main())
