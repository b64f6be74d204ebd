"""``python -m guard_trio`` runs the ``inference-guard`` command line."""

import sys

from guard_trio.cli import main

sys.exit(main())
