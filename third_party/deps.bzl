"""kvoffload_deps(): the repositories kvoffload needs. A consumer's WORKSPACE calls it."""

load("@bazel_tools//tools/build_defs/repo:utils.bzl", "maybe")
load("//third_party:pins.bzl", "NANOBIND_WHEEL")
load("//third_party/cuda:cuda_configure.bzl", "cuda_configure")
load("//third_party/pip:pip_wheel.bzl", "pip_wheel_repository")
load("//third_party/python:python_configure.bzl", "python_configure")
load("//third_party/stubs:stub_repository.bzl", "CC_RULES", "JAVA_RULES", "stub_repository")
load("//third_party/wheel:version_repository.bzl", "version_repository")

def kvoffload_deps():
    maybe(stub_repository, name = "rules_cc", package = "cc", rules = CC_RULES)
    maybe(stub_repository, name = "rules_java", package = "java", rules = JAVA_RULES)
    maybe(python_configure, name = "kvoffload_python")
    maybe(cuda_configure, name = "kvoffload_cuda")
    package, version, sha256 = NANOBIND_WHEEL
    maybe(
        pip_wheel_repository,
        name = "kvoffload_nanobind",
        package = package,
        version = version,
        sha256 = sha256,
        strip_prefix = "nanobind",
        build_file = Label("//third_party/nanobind:nanobind.BUILD"),
    )
    maybe(
        version_repository,
        name = "kvoffload_version",
        version_file = Label("//py/kvoffload:__init__.py"),
    )
    native.register_toolchains("@kvoffload_python//:python_toolchain")
