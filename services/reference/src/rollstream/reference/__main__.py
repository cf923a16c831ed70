from rollstream.reference.service import main

raise SystemExit(main())
