"""Install the top-level folders under one namespace: core/ -> specbus.core, bus/ -> specbus.bus, ...

The tree keeps its layout (core/, bus/, producers/, consumers/, ops/, patches/ at the top);
setuptools' package_dir maps each one under `specbus`, an implicit namespace package, so the
installed distribution exposes only `specbus` (tests/test_architecture.py checks it).
Everything else is in pyproject.toml.
"""

from setuptools import find_packages, setup

TOP = ["core", "bus", "producers", "consumers", "ops", "patches"]
FOUND = find_packages(include=[*TOP, *(f"{t}.*" for t in TOP)])

setup(
    packages=[f"specbus.{p}" for p in FOUND],
    package_dir={f"specbus.{t}": t for t in TOP},
)
