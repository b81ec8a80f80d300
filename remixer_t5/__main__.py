"""`python -m remixer_t5 ...` is the `remixer-t5` command."""

import sys

from remixer_t5.cli import console_main

sys.exit(console_main())
