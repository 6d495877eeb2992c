"""``python -m bench [options]``: see ``bench.run`` (``--help`` lists the options)."""
import sys

from .run import main

sys.exit(main())
