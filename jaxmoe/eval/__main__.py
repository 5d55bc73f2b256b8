import sys

from jaxmoe.eval.harness import main

sys.exit(main())
