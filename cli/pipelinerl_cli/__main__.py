import sys

from pipelinerl_cli.main import main

sys.exit(main())
