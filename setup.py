"""The packages to install; everything else is in pyproject.toml.

Every package under meshdsl/ (found, so a new subpackage needs no edit here), plus the
repository's models/ and layouts/ folders, which pyproject.toml's package-dir installs as
meshdsl.models and meshdsl.layouts.
"""

from setuptools import find_packages, setup

setup(packages=[*find_packages(include=["meshdsl", "meshdsl.*"]), "meshdsl.models", "meshdsl.layouts"])
