import sys

from songserve.client import main

sys.exit(main())
