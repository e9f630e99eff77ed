"""``python -m minizero.checkpoint inspect|consolidate PATH`` (see :mod:`minizero.checkpoint.cli`)."""
import sys

from minizero.checkpoint.cli import main

sys.exit(main())
