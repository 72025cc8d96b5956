"""Offline stand-ins for rules_cc and rules_java: thin forwards to Bazel's native rules.

Bazel 4's own tools load these repositories, which it would otherwise download.
"""

_CC_RULES = [
    "cc_binary",
    "cc_import",
    "cc_library",
    "cc_proto_library",
    "cc_shared_library",
    "cc_test",
    "cc_toolchain",
    "cc_toolchain_suite",
    "fdo_prefetch_hints",
    "fdo_profile",
    "objc_import",
    "objc_library",
]

_JAVA_RULES = [
    "java_binary",
    "java_import",
    "java_library",
    "java_lite_proto_library",
    "java_package_configuration",
    "java_plugin",
    "java_proto_library",
    "java_runtime",
    "java_test",
    "java_toolchain",
]

def _forwards(rules):
    return "\n".join([
        "def {0}(**kwargs):\n    native.{0}(**kwargs)\n".format(r)
        for r in rules
    ])

def _stub_repository_impl(ctx):
    ctx.file("WORKSPACE", 'workspace(name = "{}")\n'.format(ctx.name))
    ctx.file("BUILD.bazel", "")
    ctx.file(ctx.attr.package + "/BUILD.bazel", "")
    ctx.file(ctx.attr.package + "/defs.bzl", _forwards(ctx.attr.rules))

stub_repository = repository_rule(
    implementation = _stub_repository_impl,
    attrs = {
        "package": attr.string(mandatory = True),
        "rules": attr.string_list(mandatory = True),
    },
)

CC_RULES = _CC_RULES
JAVA_RULES = _JAVA_RULES
