#!/usr/bin/env python
"""Batch inference over a tokenized .h5 prompt set. See README.md, or run with --help."""
import sys

from modelzoo.job.cli import main

if __name__ == "__main__":
    sys.exit(main())
