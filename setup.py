"""Build of nnscaler-eval: one C extension, nnscaler_eval._C, from compat/, csrc/ and guards/.

NNSCALER_SANITIZE=1 builds with AddressSanitizer and UndefinedBehaviorSanitizer
(`make asan`); NNSCALER_DEBUG=1 keeps assertions and turns optimisation off.
"""
import glob
import os

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

# The import hook's start-up line. It must sit at the top of site-packages (that is
# where `site` reads *.pth files), so build_py copies it beside the packages; a wheel
# built from build_lib then installs it there and records it, and `pip uninstall`
# removes it. See _nnscaler_eval_ns.py for why there is no `nnscaler/` directory.
PTH = "nnscaler_eval_ns.pth"


class build_py_with_pth(build_py):
    def run(self):
        super().run()
        self.copy_file(PTH, os.path.join(self.build_lib, PTH), preserve_mode=0)

    def get_outputs(self, include_bytecode=True):
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, PTH)]

    def get_output_mapping(self):
        mapping = super().get_output_mapping()
        mapping[os.path.join(self.build_lib, PTH)] = PTH
        return mapping

sanitize = os.environ.get("NNSCALER_SANITIZE") == "1"
debug = os.environ.get("NNSCALER_DEBUG") == "1" or sanitize

# Hidden visibility: only PyInit__C leaves the object, so calls and data between our
# files are direct, not through the PLT and GOT (the evaluator's every frame makes some).
extra_compile_args = ["-Wall", "-Wextra", "-Werror=implicit-function-declaration",
                      "-Wno-missing-field-initializers", "-std=c11", "-fvisibility=hidden"]
extra_link_args = []
undef_macros = []
if debug:
    extra_compile_args += ["-O0", "-g3"]
    undef_macros.append("NDEBUG")
else:
    extra_compile_args += ["-O2"]
if sanitize:
    flags = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer",
             "-fno-sanitize-recover=undefined"]
    extra_compile_args += flags
    extra_link_args += flags
if os.environ.get("NNSCALER_WERROR") == "1":
    extra_compile_args.append("-Werror")

# compat/ is the version layer below both csrc/ (the shim) and guards/ (docs/design.md).
sources = [path for folder in ("compat", "csrc", "guards")
           for path in sorted(glob.glob(f"{folder}/*.c"))]
# The two C++ translation units (guards/tensor_meta.cpp: what the call key reads of a
# tensor; csrc/replay_tensors.cpp: the copies and clones of a graph replay) use the
# headers of the torch installed at build time; their own flags are set in
# build_ext_per_language (setuptools passes one set of flags to every source).
sources += ["guards/tensor_meta.cpp", "csrc/replay_tensors.cpp"]


def _torch_build_info():
    """(include dirs, library dir, C++ ABI macro value) of the installed torch, or None."""
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:
        return None
    lib_dir = os.path.join(os.path.dirname(torch.__file__), "lib")
    return cpp_extension.include_paths(), lib_dir, int(torch._C._GLIBCXX_USE_CXX11_ABI)


torch_info = _torch_build_info()
cxx_args = ["-Wall", "-Wextra", "-std=c++17", "-fvisibility=hidden"]
if torch_info is None:
    cxx_args.append("-DNNS_NO_TORCH_HEADERS")
    libraries, library_dirs, runtime_dirs = ["xxhash"], [], []
else:
    includes, lib_dir, abi = torch_info
    for include in includes:
        cxx_args += ["-isystem", include]   # torch's own warnings are not ours
    cxx_args.append(f"-D_GLIBCXX_USE_CXX11_ABI={abi}")
    # torch is imported before _C (nnscaler_eval/__init__.py), so these are already
    # loaded; the run path finds them when something imports _C on its own.
    libraries = ["xxhash", "torch_python", "torch_cpu", "c10"]
    library_dirs, runtime_dirs = [lib_dir], [lib_dir]


C_ONLY = ("-std=c11", "-Werror=implicit-function-declaration")


class build_ext_per_language(build_ext):
    """C sources get the C flags, the C++ source gets cxx_args."""

    def build_extensions(self):
        compile_one = self.compiler._compile

        def _compile(obj, src, ext, cc_args, extra_postargs, pp_opts):
            if src.endswith(".cpp"):
                extra_postargs = [a for a in extra_postargs if a not in C_ONLY] + cxx_args
            return compile_one(obj, src, ext, cc_args, extra_postargs, pp_opts)

        self.compiler._compile = _compile
        super().build_extensions()

setup(
    cmdclass={"build_py": build_py_with_pth, "build_ext": build_ext_per_language},
    ext_modules=[
        Extension(
            "nnscaler_eval._C",
            sources=sources,
            language="c++",   # linked by the C++ driver: libstdc++ for tensor_meta.cpp
            include_dirs=["compat", "csrc", "guards"],
            libraries=libraries,
            library_dirs=library_dirs,
            runtime_library_dirs=runtime_dirs,
            extra_compile_args=extra_compile_args,
            extra_link_args=extra_link_args,
            undef_macros=undef_macros,
        )
    ],
)
