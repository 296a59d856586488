"""Build of nnscaler-eval: one C extension, nnscaler_eval._C, from csrc/ and guards/.

NNSCALER_SANITIZE=1 builds with AddressSanitizer and UndefinedBehaviorSanitizer
(`make asan`); NNSCALER_DEBUG=1 keeps assertions and turns optimisation off.
"""
import glob
import os

from setuptools import Extension, setup
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

extra_compile_args = ["-Wall", "-Wextra", "-Werror=implicit-function-declaration",
                      "-Wno-missing-field-initializers", "-std=c11"]
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

sources = sorted(glob.glob("csrc/*.c")) + sorted(glob.glob("guards/*.c"))

setup(
    cmdclass={"build_py": build_py_with_pth},
    ext_modules=[
        Extension(
            "nnscaler_eval._C",
            sources=sources,
            include_dirs=["csrc", "guards"],
            libraries=["xxhash"],
            extra_compile_args=extra_compile_args,
            extra_link_args=extra_link_args,
            undef_macros=undef_macros,
        )
    ],
)
