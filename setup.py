"""The package list for setuptools (the rest of the build is in pyproject.toml).

The apps' packages are found; lua/ and templates/ join them as data-only packages mapped in
by pyproject.toml's package-dir, which a `packages.find` table cannot list beside them.
"""

from setuptools import find_packages, setup

APPS = ["fairqueue", "fairqueue.*", "tenants", "tenants.*", "dashboard", "dashboard.*", "webhooks", "webhooks.*"]
MAPPED = ["fairqueue.engine.lua", "fairqueue.templates"]

setup(packages=find_packages(include=APPS) + MAPPED)
