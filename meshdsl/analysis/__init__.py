"""Reading programs: the jaxpr a function traces to and the HLO XLA compiles it to.

:mod:`.jaxpr_walk` walks a traced step (what it stores, what its loops carry), :mod:`.hlo` finds the
collectives and their bytes in compiled HLO text, :mod:`.hlo_flops` counts its FLOPs, and
:mod:`.user_lines` finds the user's own source line behind an operation. ``md.explain`` and the
planner predict from the first; the tests and ``meshdsl bench`` check those predictions with the
second and third.
"""
