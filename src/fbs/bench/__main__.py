"""``python -m fbs.bench [options]`` = ``fbs bench [options]``."""

import sys

from fbs.cli import main

sys.exit(main(["bench", *sys.argv[1:]]))
