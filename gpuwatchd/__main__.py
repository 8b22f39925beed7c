"""``python -m gpuwatchd`` runs the command line."""

import sys

from gpuwatchd.cli.main import main

sys.exit(main())
