"""``python -m meshdsl ...``: the ``meshdsl`` command (:func:`meshdsl.cli.main`)."""

import sys

from meshdsl.cli import main

sys.exit(main())
