#!/usr/bin/env python
"""Progress of a running fairseq-generate: sentences translated of the total, while it translates.

The command line only; the code is :mod:`deepinit_tools.generate_progress`.
"""

import sys

from deepinit_tools.generate_progress import main

if __name__ == "__main__":
    sys.exit(main())
