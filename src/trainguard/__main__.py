"""``python -m trainguard ...``: the same command as the ``trainguard`` console script (job
scripts on clusters often have only ``python`` on PATH)."""

import sys

from trainguard.cli import main

sys.exit(main())
