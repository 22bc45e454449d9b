"""`python -m kvpool_cli ...`: the same as the `kvpool` console script."""

import sys

from kvpool_cli.main import main

sys.exit(main())
