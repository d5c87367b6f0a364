"""gpuvisor's version, written in this one place.

pyproject.toml reads it (setuptools' `dynamic` version from this attribute), so the installed
package's metadata, every `--version` and the `gpuvisor_build_info` metric say the same without
`importlib.metadata`, whose imports (email, zipfile, ...) would weigh on the process that asks
(docs/performance.md).
"""

VERSION = "0.1.0"
