import sys

from moe_infer.cli import main

sys.exit(main())
