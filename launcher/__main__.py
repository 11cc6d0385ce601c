"""``python -m launcher ...``: the ``etagent`` command without its console script."""

import sys

from launcher.main import main

sys.exit(main())
