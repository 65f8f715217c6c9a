"""`python -m dblast_ext.cli ...` (what torchrun launches: `torchrun ... -m dblast_ext.cli train ...`)."""
import sys

from . import main

sys.exit(main())
