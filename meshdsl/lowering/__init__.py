"""Lowerings: how the ops run. ``GlobalLowering`` (eager and gspmd) sees global arrays and nothing
split; ``SpmdLowering`` sees this device's shards and emits the collectives itself."""
