"""``python -m decoderlab.cli ARGS``: the ``decoderlab`` command."""

import sys

from . import main

sys.exit(main())
