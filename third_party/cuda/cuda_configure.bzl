"""Finds the local CUDA toolkit: $CUDA_PATH, else /usr/local/cuda."""

def _cuda_configure_impl(ctx):
    root = ctx.os.environ.get("CUDA_PATH", "/usr/local/cuda")
    nvcc = ctx.path(root + "/bin/nvcc")
    if not nvcc.exists:
        fail("kvoffload cuda_configure: no nvcc under {}; install the CUDA toolkit (13.0) ".format(root) +
             "or set CUDA_PATH to its root")
    if not ctx.path(root + "/lib64/libcudart_static.a").exists:
        fail("kvoffload cuda_configure: {}/lib64/libcudart_static.a is missing; ".format(root) +
             "install the CUDA runtime's static library (cuda-cudart-dev)")

    # The whole toolkit: nvcc.profile finds its tools relative to nvcc itself.
    ctx.symlink(root, "cuda")
    ctx.template("BUILD.bazel", ctx.attr._build_tpl, {})

cuda_configure = repository_rule(
    implementation = _cuda_configure_impl,
    environ = ["CUDA_PATH"],
    local = True,
    attrs = {
        "_build_tpl": attr.label(default = Label("//third_party/cuda:BUILD.tpl")),
    },
)
