"""``python -m exitlm`` (also what ``torchrun -m exitlm`` runs)."""

import sys

from exitlm.cli import main

sys.exit(main())
