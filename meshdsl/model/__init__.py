"""What meshdsl knows of a model: the protocol it follows, and how a command finds and builds one.

:mod:`.protocol` states what a model provides (``init``, ``loss``, ``batch``, and the optional parts
that pipelines, the planner and Hugging Face import use) as ``typing.Protocol`` classes;
:mod:`.loader` builds a shipped model or a user's file by name with ``--set`` overrides;
:mod:`.config` reads those overrides into a model's ``Config``; :mod:`.user` checks a user's model
and names what is missing in terms of their own file.
"""
