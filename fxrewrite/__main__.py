from fxrewrite.cli import main

raise SystemExit(main())
