import sys

from infera.tools.preflight.cli import main

sys.exit(main())
