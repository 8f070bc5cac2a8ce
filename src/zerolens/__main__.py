import sys

from zerolens.cli import main

sys.exit(main())
