from moe.cli import main

raise SystemExit(main())
