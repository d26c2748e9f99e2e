"""`python -m vllm_hs` runs the vllm-hs command line."""

import sys

from vllm_hs.cli import main

sys.exit(main())
