"""What bench, the planner and train share about running a step on the devices at hand.

:mod:`~meshdsl.measure.timing` compiles a step, reads its memory and times steps side by side;
:mod:`~meshdsl.measure.fits` checks that a compiled step fits a device's memory;
:mod:`~meshdsl.measure.peaks` holds the devices' datasheet peak FLOP/s; :mod:`~meshdsl.measure.sizes`
counts the bytes one device holds of a tree under a layout. It imports neither bench nor the
planner, so both can use it without importing each other.
"""
