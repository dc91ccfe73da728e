import sys

from executorch_cellcache.cli import main

sys.exit(main())
