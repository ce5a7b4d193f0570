"""`python -m fdlite ...`: the same as the `fdlite` console script."""

from fdlite.cli import main

raise SystemExit(main())
