"""The planner's commands: ``meshdsl explain``, ``meshdsl calibrate`` and ``meshdsl search``.

Each is one module of the commands wing (``meshdsl/commands/explain.py``, ``calibrate.py``,
``search.py``: its flags, checks and output); the planner itself takes no command-line arguments.
"""

COMMANDS = ("explain", "calibrate", "search")
"""The names of the planner's commands."""
