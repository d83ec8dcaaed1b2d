"""``python -m diag``."""

from diag.cli import main

raise SystemExit(main())
