pytest_plugins = ("correctness.pytest_plugin",)
