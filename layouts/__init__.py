"""The shipped layout files (``*.toml``), installed as the package data of ``meshdsl.layouts``.

This file makes the folder a package, so ``importlib.resources.files("meshdsl.layouts")`` finds
the files in an installed wheel and in an editable install alike (see ``meshdsl.train.rules``).
"""
