import sys

from nasdiag.cli import main

sys.exit(main())
