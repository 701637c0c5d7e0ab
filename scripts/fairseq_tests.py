#!/usr/bin/env python
"""fairseq's own tests without and with the plugin imported: no test may fail only with the plugin.

The command line only; the code is :mod:`deepinit_tools.fairseq_tests`.
"""

import sys

from deepinit_tools.fairseq_tests import main

if __name__ == "__main__":
    sys.exit(main())
