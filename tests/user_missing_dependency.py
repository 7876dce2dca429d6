"""A user module that imports a package this environment lacks."""

import dlpipe_test_package_that_is_not_installed  # noqa: F401
