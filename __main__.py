"""``python -m dspzoo`` (and ``accelerate launch ... -m dspzoo``) runs the ``dspzoo`` CLI."""

import sys

from dspzoo.zoo.cli import main

sys.exit(main())
