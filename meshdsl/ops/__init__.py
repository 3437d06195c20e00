"""The ops, one module per family. Each is written once against the lowering interface."""
