"""`python -m tfmp.launch`: the multi-worker launcher, kept at its documented path.

The launcher lives in `tfmp.distribute.launch`; this module only runs it, so the command that
the README, configs and cluster manifests name keeps working. See that module for the flags.
"""

import sys

from tfmp.distribute.launch import main

if __name__ == "__main__":
    sys.exit(main())
