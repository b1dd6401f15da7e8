"""python -m v41.loader write|check (v41.loader.cli)."""
import sys

from v41.loader.cli import main

sys.exit(main())
