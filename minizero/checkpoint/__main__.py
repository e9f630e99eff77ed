"""``python -m minizero.checkpoint inspect|consolidate PATH`` (see :mod:`minizero.checkpoint.cli`)."""
import sys

from minizero.checkpoint.cli import main
from minizero.interrupts import WHOLE, interruptible

sys.exit(interruptible("minizero.checkpoint", WHOLE, main))
