"""``python -m statelab.cli``."""
from statelab.cli.main import main

main()
