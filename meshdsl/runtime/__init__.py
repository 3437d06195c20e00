"""What a run needs from the machine it runs on: devices, processes, files.

:mod:`.devices` chooses simulated or real devices, :mod:`.distributed` joins a multi-process run,
:mod:`.launch` starts one on this host, :mod:`.output_paths` checks where a run may write,
:mod:`.layout_spec` finds a ``--layout`` argument's file or rules, and :mod:`.compiler_options` holds
the XLA options meshdsl compiles with.
"""
