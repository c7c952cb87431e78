import sys

from gpuid_agent.cli import main

sys.exit(main())
