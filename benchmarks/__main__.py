"""``python -m benchmarks [options]``: see ``benchmarks.run`` (``--help`` lists the options)."""
import sys

from .run import main

sys.exit(main())
