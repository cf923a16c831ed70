from rollstream.generator.service import main

raise SystemExit(main())
