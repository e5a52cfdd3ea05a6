"""``python -m ps_server``: the same as the ``ps-server`` command."""

import sys

from ps_server.cli import main

sys.exit(main())
