import sys

from launcher.cli import main

sys.exit(main())
