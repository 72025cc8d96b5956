"""Who may depend on the core's targets, for every package under cc/."""

# The C++ API other workspaces build against (docs/bazel.md, examples/consumer).
PUBLIC = ["//visibility:public"]

# What the Python extension binds, and the core's other packages.
EXTENSION = ["//py/kvoffload:__pkg__", "//cc:__subpackages__"]
