"""``python -m worker``: the same as the ``ps-worker`` command."""

import sys

from worker.cli import main

sys.exit(main())
