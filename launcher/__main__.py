"""``python -m etagent.launcher ...``: the ``etagent`` command without its console script."""

import sys

from etagent.launcher.main import main

sys.exit(main())
