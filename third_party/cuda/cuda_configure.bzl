"""@kvoffload_cuda: the CUDA toolkit and the GPU architectures to build for.

By default the toolkit is hermetic: the pinned NVIDIA wheels of //third_party:pins.bzl,
fetched with pip and checked by sha256. --repo_env=KVOFFLOAD_CUDA_PATH=/usr/local/cuda
chooses a local toolkit instead. --repo_env=KVOFFLOAD_CUDA_ARCHS=80,90,100 (the default
in pins.bzl) sets the architectures.
"""

load("//third_party:pins.bzl", "CUDA_ARCHS", "CUDA_WHEELS", "CUDA_WHEEL_ROOT")
load("//third_party/pip:pip_wheel.bzl", "fetch_wheel", "find_python")

def _fail(msg):
    fail("kvoffload cuda_configure: " + msg)

def _local_toolkit(ctx, root):
    """Links the local toolkit at `root`; returns its library directory's name."""
    if not ctx.path(root + "/bin/nvcc").exists:
        _fail("KVOFFLOAD_CUDA_PATH={}: no bin/nvcc there".format(root))
    if not ctx.path(root + "/lib64/libcudart_static.a").exists:
        _fail("KVOFFLOAD_CUDA_PATH={}: lib64/libcudart_static.a is missing; ".format(root) +
              "install the CUDA runtime's static library (cuda-cudart-dev)")

    # The whole toolkit: nvcc.profile finds its tools relative to nvcc itself.
    ctx.symlink(root, "cuda")
    return "lib64"

def _hermetic_toolkit(ctx):
    """Unpacks the pinned wheels into cuda/; returns its library directory's name."""
    python = find_python(ctx)
    for package, version, sha256 in CUDA_WHEELS:
        fetch_wheel(ctx, python, package, version, sha256, output = "cuda", strip_prefix = CUDA_WHEEL_ROOT)
    return "lib"

def _gencode(archs):
    """nvcc flags: machine code for every architecture, PTX for the newest."""
    numbers = sorted([int(a.strip()) for a in archs.split(",") if a.strip().isdigit()])
    if not numbers or len(numbers) != len(archs.split(",")):
        _fail("KVOFFLOAD_CUDA_ARCHS={}: expected compute capabilities like 80,90,100".format(archs))
    flags = ["--generate-code=arch=compute_{0},code=sm_{0}".format(n) for n in numbers[:-1]]
    flags.append("--generate-code=arch=compute_{0},code=[sm_{0},compute_{0}]".format(numbers[-1]))
    return flags

def _cuda_configure_impl(ctx):
    root = ctx.os.environ.get("KVOFFLOAD_CUDA_PATH", "")
    lib = _local_toolkit(ctx, root) if root else _hermetic_toolkit(ctx)
    ctx.template("BUILD.bazel", ctx.attr._build_tpl, {"%{lib}": lib})
    ctx.file("defs.bzl", "\n".join([
        '"""What the CUDA toolkit was configured with."""',
        "CUDA_TOOLKIT = {}".format(repr(root or "hermetic")),
        "CUDA_GENCODE = {}".format(repr(_gencode(ctx.os.environ.get("KVOFFLOAD_CUDA_ARCHS", CUDA_ARCHS)))),
        "",
    ]))

cuda_configure = repository_rule(
    implementation = _cuda_configure_impl,
    environ = ["KVOFFLOAD_CUDA_PATH", "KVOFFLOAD_CUDA_ARCHS"],
    attrs = {
        "_build_tpl": attr.label(default = Label("//third_party/cuda:BUILD.tpl")),
    },
)
