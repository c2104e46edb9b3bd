"""``python -m balancer`` == the ``balancer`` command."""

import sys

from balancer.cli import main

sys.exit(main())
