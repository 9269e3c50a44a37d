"""``python -m worker --model X --port N``: see worker/serve_main.py."""

from worker.serve_main import exit_process, main

exit_process(main())
