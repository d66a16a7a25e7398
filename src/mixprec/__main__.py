"""``python -m mixprec``: the same as the ``mixprec`` command."""

import sys

from mixprec.cli import main

sys.exit(main())
