"""`python -m proxy` is the `slotwise` command."""

from proxy.cli import main

raise SystemExit(main())
