"""commands: one module per verb's computation (estimate, plan, sweep, maxsize); the CLI (cli.py) parses
and calls them. May import everything below: run/, report/, predict/, strategies/, measure/, models/."""
