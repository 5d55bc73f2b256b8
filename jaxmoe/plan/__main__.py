import sys

from jaxmoe.plan.planner import main

sys.exit(main())
