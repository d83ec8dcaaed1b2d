"""``python -m diag``."""

from diag.cli.commands import main

raise SystemExit(main())
