"""``python -m worker --model X --port N``: see worker/serve/main.py."""

from worker.serve.main import exit_process, main

exit_process(main())
