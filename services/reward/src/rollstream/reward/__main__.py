"""`python -m rollstream.reward --redis-url ... --run ...`"""

from rollstream.reward.service import main

raise SystemExit(main())
