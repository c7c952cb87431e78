"""`python -m gpuid_agent.docs`: write (or `--check`) the generated reference pages."""

from gpuid_agent.docs import main

raise SystemExit(main())
