from onecard.cli import main

raise SystemExit(main())
