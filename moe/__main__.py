from moe.tools.cli import main

raise SystemExit(main())
